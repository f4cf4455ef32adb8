"""A nan/inf loss or gradient norm during training (swift_mcore/training/nonfinite.py): the
run stops before the optimizer step with an error naming the iteration, no checkpoint
holding nan is written, the tracker keeps the last good one and --resume continues from it;
with --nonfinite_policy skip the step is dropped and counted. Every rank decides the same
(DP=2: one rank's nan; PP=2: the loss exists only on the last stage).

Non-finite steps come from a real divergence (--lr 1e30 through the CLI) and, at chosen
iterations and ranks, from ckpt_worker.py's "poison" (a compute_loss override on the
Python API, as examples/custom_trainer.py does)."""

import json
import os
import subprocess
import sys

import pytest
import torch

import ckpt_harness as H
from run_helpers import checkpoint_tensors
from swift_mcore.checkpointing import commit, folders

GBS = H.TINY["global_batch_size"]


def ckpt(out, iteration):
    return os.path.join(out, "checkpoint", folders.iter_dir_name(iteration))


def tensors(folder, tmp_path):
    """Every floating tensor of a checkpoint (model and optimizer state), by name."""
    found = checkpoint_tensors(folder, tmp_path, lambda name, t: t.is_floating_point())
    assert any(k.startswith("embedding") for k in found), sorted(found)[:5]
    return found


def assert_finite_checkpoints(out, tmp_path, expected):
    root = os.path.join(out, "checkpoint")
    assert [it for it, _ in commit.complete_checkpoints(root)] == expected
    assert not H.staging_folders(out), "a save was started after the non-finite step"
    assert folders.read_latest(root)[0] == expected[-1]
    for it in expected:
        values = tensors(ckpt(out, it), tmp_path)
        bad = [k for k, v in values.items() if not torch.isfinite(v).all()]
        assert not bad, (it, bad)


def error_messages(out, world_size):
    errors = [H.records(out, "error", r) for r in range(world_size)]
    assert all(errors), f"a rank did not stop: {errors}"
    assert {e[-1]["type"] for e in errors} == {"NonFiniteError"}, errors
    return [e[-1]["message"] for e in errors]


@pytest.mark.slow
def test_a_diverging_run_stops_with_exit_2_before_writing_nan(tmp_path):
    """A real divergence: with --lr 1e30 the first step is finite (the tracker names it),
    the second step's gradients are nan: exit 2, one line naming the iteration, no save of
    iteration 2 or at the end, the saved weights and Adam moments finite."""
    out = tmp_path / "run"
    corpus = H.write_corpus(str(tmp_path / "corpus.jsonl"))
    cmd = [sys.executable, "-m", "swift_mcore", "pt", "--dataset", corpus, "--split", "90,10,0",
           *[f"--{k}={v}" for k, v in {**H.TINY, "log_sample_ids": False}.items()],
           "--lr", "1e30", "--min_lr", "0", "--lr_warmup_iters", "0", "--train_iters", "5",
           "--save_steps", "1", "--output_dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=H.REPO)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0].startswith("swift-mcore pt: error: iteration 2: the ")
    assert "is nan" in errors[0] and "stopped before the optimizer step" in errors[0]
    assert f"{ckpt(str(out), 1)}, is what --resume takes" in errors[0]
    assert "finished at iteration" not in proc.stdout
    assert_finite_checkpoints(str(out), tmp_path, [1])
    assert [r["iteration"] for r in map(json.loads, (out / "metrics.jsonl").open())
            if r["split"] == "train"] == [1]


@pytest.mark.slow
def test_nan_mid_run_stops_and_resume_continues_from_the_last_good_checkpoint(
        tmp_path, flags):
    out = str(tmp_path / "run")
    f = {**flags, "train_iters": 6, "save_steps": 2}
    H.run(out, f, 1, expect_error=True,
          extra={"poison": {"iterations": [5], "what": "both"}})
    [message] = error_messages(out, 1)
    assert message.startswith("iteration 5: the loss is nan (gradient norm nan); stopped "
                              "before the optimizer step"), message
    assert f"{ckpt(out, 4)}, is what --resume takes" in message
    assert list(H.trace(out)) == [1, 2, 3, 4]
    assert_finite_checkpoints(out, tmp_path, [2, 4])

    H.run(out, {**f, "resume": "auto"}, 1, tag="resume")
    assert H.records(out, "setup")[-1]["state"]["iteration"] == 4
    done = H.records(out, "done")[-1]["state"]
    assert done["iteration"] == 6 and done["skipped_train_samples"] == 0
    assert folders.read_latest(os.path.join(out, "checkpoint"))[0] == 6


@pytest.mark.slow
def test_skip_policy_drops_the_step_and_counts_it(tmp_path, flags):
    """Iteration 3 is non-finite: skipped, its samples consumed, parameters, Adam state and
    scheduler those of iteration 2; the run trains on to the end."""
    out = str(tmp_path / "run")
    f = {**flags, "train_iters": 4, "save_steps": 1, "lr_warmup_iters": 0,
         "nonfinite_policy": "skip"}
    seg = H.run(out, f, 1, extra={"poison": {"iterations": [3], "what": "both"}})
    done = H.records(out, "done")[-1]["state"]
    assert done["iteration"] == 4 and done["consumed_train_samples"] == 4 * GBS
    assert done["skipped_train_samples"] == GBS
    log = open(seg.logs[0], encoding="utf-8").read()
    assert "warning: iteration 3: the loss is nan (gradient norm nan); step skipped" in log
    before, after = tensors(ckpt(out, 2), tmp_path), tensors(ckpt(out, 3), tmp_path)
    assert before.keys() == after.keys() and any("optimizer" in k for k in before)
    for name, value in before.items():
        assert torch.equal(value, after[name]), name
    later = tensors(ckpt(out, 4), tmp_path)
    assert not all(torch.equal(v, later[k]) for k, v in before.items())  # 4 trained
    from swift_mcore.checkpointing.io import read_common

    schedulers = [read_common(ckpt(out, i))["opt_param_scheduler"] for i in (2, 3, 4)]
    # common.pt counts the scheduler's steps in samples, as Megatron-LM does
    assert [s["num_steps"] for s in schedulers] == [2 * GBS, 2 * GBS, 3 * GBS]
    metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    skipped = {r["iteration"]: r["skipped"] for r in metrics if r["split"] == "train"}
    assert skipped == {1: 0, 2: 0, 3: 1, 4: 0}
    assert all("loss" in r for r in metrics if r["iteration"] == 4)


@pytest.mark.slow
def test_dp2_one_ranks_nan_is_skipped_by_both_ranks_until_the_limit(tmp_path, flags):
    """DP=2, nan gradients on rank 1 only: both ranks skip iteration 2, and at iteration 3,
    the second in a row over --nonfinite_skip_limit 1, both stop; nothing hangs."""
    out = str(tmp_path / "run")
    f = {**flags, "train_iters": 5, "save_steps": 1, "nonfinite_policy": "skip",
         "nonfinite_skip_limit": 1}
    H.run(out, f, 2, expect_error=True,
          extra={"poison": {"iterations": [2, 3], "ranks": [1], "what": "grad"}})
    for message in error_messages(out, 2):
        assert message.startswith("iteration 3: the gradient norm is nan (the loss is "
                                  "finite); 2 non-finite steps in a row exceed "
                                  "--nonfinite_skip_limit 1"), message
    assert_finite_checkpoints(out, tmp_path, [1, 2])
    assert json.load(open(os.path.join(ckpt(out, 2), "train_state.json")))[
        "skipped_train_samples"] == GBS


@pytest.mark.slow
def test_pp2_a_loss_known_only_on_the_last_stage_stops_both_stages(tmp_path, flags):
    """PP=2: the reported loss is nan on the last stage only (the gradients are finite), so
    the first stage learns it only from the agreement; both stop at iteration 2."""
    out = str(tmp_path / "run")
    f = {**flags, "train_iters": 4, "save_steps": 1, "pipeline_model_parallel_size": 2}
    H.run(out, f, 2, expect_error=True,
          extra={"poison": {"iterations": [2], "what": "loss"}})
    for message in error_messages(out, 2):
        assert message.startswith("iteration 2: the loss is nan (gradient norm finite); "
                                  "stopped before the optimizer step"), message
    assert_finite_checkpoints(out, tmp_path, [1])


def poison_weights(folder, tmp_path, name="embedding.word_embeddings.weight"):
    """What bit rot sealed over, or an external writer, leaves: one value of the weights
    ``name`` set to nan in the shard files, the manifest's checksums written to match (a
    Megatron-LM checkpoint has none to update). Returns how many values of it there are."""
    found = tensors(folder, tmp_path)
    keys = [k for k in found if k.endswith(name) and "optimizer" not in k]
    assert len(keys) == 1, sorted(found)
    value = found[keys[0]]
    pattern = value.reshape(-1)[:16].numpy().tobytes()
    hits = 0
    for file in sorted(os.listdir(folder)):
        if not file.endswith(".distcp"):
            continue
        path = os.path.join(folder, file)
        data = bytearray(open(path, "rb").read())
        at = data.find(pattern)
        while at >= 0:  # the weights, and the optimizer's copy of them if it keeps one
            data[at:at + 4] = torch.tensor([float("nan")], dtype=value.dtype).numpy().tobytes()
            hits += 1
            at = data.find(pattern, at + 1)
        open(path, "wb").write(bytes(data))
    assert hits, "the weights' bytes were not found"
    manifest_path = os.path.join(folder, commit.MANIFEST_FILENAME)
    manifest = json.load(open(manifest_path))
    for rel, entry in manifest["files"].items():
        entry["size"], entry["crc32"] = commit.checksum(os.path.join(folder, rel))
    json.dump(manifest, open(manifest_path, "w"))
    return value.numel()


def test_a_checkpoint_holding_nan_is_refused_on_resume_and_export(tmp_path):
    """NaN written into a saved checkpoint's weights: resuming refuses it before the first
    step (one line naming the checkpoint and the tensor, exit 2), so the non-finite stop can
    never name it as the newest good one; export refuses it too; nothing on disk changes."""
    out = tmp_path / "run"
    corpus = H.write_corpus(str(tmp_path / "corpus.jsonl"))
    flags = [f"--{k}={v}" for k, v in {**H.TINY, "log_sample_ids": False, "lr_warmup_iters": 0,
                                         "lr_decay_style": "constant"}.items()]
    base = [sys.executable, "-m", "swift_mcore", "pt", "--dataset", corpus, "--split", "90,10,0",
            *flags, "--train_iters", "4", "--save_steps", "2", "--output_dir", str(out)]
    first = subprocess.run([*base, "--exit_interval", "2"], capture_output=True, text=True,
                           timeout=240, cwd=H.REPO)
    assert first.returncode == 0, first.stderr[-3000:]
    folder = ckpt(str(out), 2)
    numel = poison_weights(folder, tmp_path)
    before = H.tree_snapshot(str(out / "checkpoint"))

    expected = (f"checkpoint {folder} cannot be used: its weights are not finite "
                f"(embedding.word_embeddings.weight holds 1 nan of {numel} values); use an "
                f"earlier checkpoint. Nothing was changed on disk.")
    resumed = subprocess.run([*base, "--resume", "auto"], capture_output=True, text=True,
                             timeout=240, cwd=H.REPO)
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    assert resumed.stderr.strip().splitlines()[-1] == f"swift-mcore pt: error: {expected}"
    assert "iteration 3" not in resumed.stdout

    exported = subprocess.run([sys.executable, "-m", "swift_mcore", "export", "--to_hf",
                               "--model", folder, "--output_dir", str(tmp_path / "hf")],
                              capture_output=True, text=True, timeout=240, cwd=H.REPO)
    assert exported.returncode == 2, exported.stderr[-3000:]
    assert exported.stderr.strip().splitlines()[-1] == f"swift-mcore export: error: {expected}"
    assert not (tmp_path / "hf").exists()
    assert H.tree_snapshot(str(out / "checkpoint")) == before
