"""Bad input on resume: each case stops with a clear error naming the problem (or falls
back with a warning where the issue asks for it), and nothing on disk is lost. Also the
override flags, --no_load_optim/--no_load_rng, --finetune and safe loading.

The checkpoints come from real training subprocesses; the resume attempts run in this
process (Trainer.setup on a one-rank gloo group), which is fast."""

import os
import pickle
import shutil

import pytest
import torch

import ckpt_harness as H
from swift_mcore.errors import ArgumentError
from swift_mcore.errors import CheckpointError
from swift_mcore.checkpointing import commit
from swift_mcore.checkpointing.folders import LATEST_FILENAME, write_latest

GBS = H.TINY["global_batch_size"]


@pytest.fixture(scope="module")
def made(tmp_path_factory, flags):
    """A run saved at iterations 2 and 4, and one saved without optimizer and RNG."""
    base = tmp_path_factory.mktemp("bad_input")
    good = str(base / "good")
    H.run(good, {**flags, "train_iters": 4, "save_steps": 2}, 1)
    bare = str(base / "bare")
    H.run(bare, {**flags, "train_iters": 3, "no_save_optim": True, "no_save_rng": True}, 1)
    return {"good": good, "bare": bare, "flags": {**flags, "train_iters": 4,
                                                  "num_workers": 0}}


@pytest.fixture
def in_process(trainer_setup):
    """Trainer.setup here (conftest.trainer_setup)."""
    return trainer_setup


def copy_run(made, tmp_path, name="good"):
    out = str(tmp_path / "run")
    shutil.copytree(made[name], out, ignore=shutil.ignore_patterns("data_cache"))
    return out


def ckpt(out, it):
    return os.path.join(out, "checkpoint", f"iter_{it:07d}")


def expect_error(setup, match, out, kind=CheckpointError, **flags):
    root = os.path.join(out, "checkpoint")
    before = H.tree_snapshot(root)
    with pytest.raises(kind) as info:
        setup(**flags)
    assert H.tree_snapshot(root) == before, "the failed resume changed files on disk"
    text = str(info.value)
    for part in [match] if isinstance(match, str) else match:
        assert part in text, text
    return text


def test_missing_checkpoint_path(made, tmp_path, in_process):
    with pytest.raises(ArgumentError, match="--resume .*/nope: no such checkpoint folder"):
        in_process(**made["flags"], output_dir=str(tmp_path / "o"),
                   resume=str(tmp_path / "nope"))


def test_truncated_checkpoint_named_explicitly(made, tmp_path, in_process):
    out = copy_run(made, tmp_path)
    with open(os.path.join(ckpt(out, 4), "__0_0.distcp"), "r+b") as fh:
        fh.truncate(1000)
    expect_error(in_process, ["is not a usable checkpoint", "__0_0.distcp has 1000 bytes"],
                 out, **made["flags"], output_dir=out, resume=ckpt(out, 4))


def test_truncated_latest_falls_back_to_previous(made, tmp_path, in_process, capsys):
    out = copy_run(made, tmp_path)
    with open(os.path.join(ckpt(out, 4), "__0_1.distcp"), "r+b") as fh:
        fh.truncate(10)
    trainer = in_process(**made["flags"], output_dir=out, resume="auto")
    assert trainer.state.iteration == 2
    assert trainer.state.consumed_train_samples == 2 * GBS
    log = capsys.readouterr().out
    assert "WARNING" in log and "falling back to the newest complete checkpoint" in log
    assert os.path.exists(ckpt(out, 4))  # left for inspection, not deleted


def test_corrupted_checkpoint(made, tmp_path, in_process):
    out = copy_run(made, tmp_path)
    path = os.path.join(ckpt(out, 4), "__0_0.distcp")
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))
    expect_error(in_process, ["is corrupted: __0_0.distcp does not match its checksum",
                              "Other complete checkpoints", "iter_0000002"],
                 out, **made["flags"], output_dir=out, resume="auto")


def test_tracker_pointing_nowhere_falls_back(made, tmp_path, in_process, capsys):
    out = copy_run(made, tmp_path)
    write_latest(os.path.join(out, "checkpoint"), 999)
    trainer = in_process(**made["flags"], output_dir=out, resume="auto")
    assert trainer.state.iteration == 4
    assert "names iteration 999" in capsys.readouterr().out


def test_tracker_pointing_nowhere_without_any_checkpoint(made, tmp_path, in_process):
    out = str(tmp_path / "run")
    os.makedirs(os.path.join(out, "checkpoint"))
    with open(os.path.join(out, "checkpoint", LATEST_FILENAME), "w") as fh:
        fh.write("7\n")
    expect_error(in_process, ["names iteration 7", "no other complete checkpoint"], out,
                 **made["flags"], output_dir=out, resume="auto")


@pytest.mark.parametrize("change,lines", [
    ({"global_batch_size": 8}, ["--global_batch_size: checkpoint 4, now 8"]),
    ({"seq_length": 64}, ["--seq_length: checkpoint 32, now 64"]),
    ({"seed": 7}, ["--seed: checkpoint 42, now 7"]),
    ({"lr": 5e-4}, ["max_lr (--lr): checkpoint 0.001, now 0.0005"]),
    ({"hidden_size": 128}, ["--hidden_size: checkpoint 64, now 128",
                            "--ffn_hidden_size: checkpoint"]),
])
def test_changed_run_is_refused(made, tmp_path, in_process, change, lines):
    out = copy_run(made, tmp_path)
    text = expect_error(in_process, ["refusing to resume", "--override_resume_check"] + lines,
                        out, **{**made["flags"], **change}, output_dir=out, resume="auto")
    assert text.count("\n  ") == len(lines) + (1 if "seq_length" in change else 0)


def test_changed_data_is_refused(made, tmp_path, in_process):
    out = copy_run(made, tmp_path)
    other = H.write_corpus(str(tmp_path / "other.jsonl"), n_docs=20, seed=99)
    expect_error(in_process, ["training data (content fingerprint): checkpoint"], out,
                 **{**made["flags"], "dataset": [other]}, output_dir=out, resume="auto")


def test_override_resume_check(made, tmp_path, in_process, capsys):
    out = copy_run(made, tmp_path)
    trainer = in_process(**{**made["flags"], "global_batch_size": 8},
                         override_resume_check=True, output_dir=out, resume="auto")
    assert trainer.state.iteration == 4 and trainer.state.consumed_train_samples == 16
    assert "--override_resume_check: resuming although --global_batch_size: checkpoint 4, " \
           "now 8" in capsys.readouterr().out


def test_incompatible_model_even_with_override(made, tmp_path, in_process):
    out = copy_run(made, tmp_path)
    expect_error(in_process, ["does not fit this model", "decoder.final_layernorm.weight: "
                              "checkpoint shape [64], model [128]"],
                 out, **{**made["flags"], "hidden_size": 128}, override_resume_check=True,
                 output_dir=out, resume="auto")


def test_fresh_run_over_existing_checkpoints_is_refused(made, tmp_path, in_process):
    out = copy_run(made, tmp_path)
    expect_error(in_process, ["already holds checkpoints", "Pass --resume"], out,
                 **made["flags"], output_dir=out)


def test_resume_with_nothing_saved_starts_fresh(made, tmp_path, in_process, capsys):
    out = str(tmp_path / "empty")
    trainer = in_process(**made["flags"], output_dir=out, resume="auto")
    assert trainer.state.iteration == 0
    assert "no checkpoint under" in capsys.readouterr().out


def test_missing_optimizer_and_rng_need_the_flags(made, tmp_path, in_process, capsys):
    out = copy_run(made, tmp_path, "bare")
    f = {**made["flags"], "train_iters": 3}
    expect_error(in_process, ["has no optimizer state", "--no_load_optim"], out,
                 **f, output_dir=out, resume="auto")
    expect_error(in_process, ["has no RNG states", "--no_load_rng"], out,
                 **f, output_dir=out, resume="auto", no_load_optim=True)
    trainer = in_process(**f, output_dir=out, resume="auto", no_load_optim=True,
                         no_load_rng=True)
    assert trainer.state.iteration == 3
    log = capsys.readouterr().out
    assert "--no_load_optim: optimizer state NOT restored" in log
    assert "--no_load_rng: RNG states NOT restored" in log


def test_finetune_takes_weights_only(made, tmp_path, in_process, capsys):
    resumed = in_process(**made["flags"], output_dir=copy_run(made, tmp_path),
                         resume="auto")
    weights = {k: v.clone() for k, v in resumed.model[0].module.state_dict().items()
               if isinstance(v, torch.Tensor)}
    assert resumed.state.iteration == 4
    tuned = in_process(**made["flags"], output_dir=str(tmp_path / "ft"), finetune=True,
                       load=os.path.join(made["good"], "checkpoint"))
    assert tuned.state.iteration == 0 and tuned.state.consumed_train_samples == 0
    got = tuned.model[0].module.state_dict()
    for key, value in weights.items():
        assert torch.equal(got[key], value), key
    assert tuned.scheduler.num_steps == 0
    assert all(not s for s in tuned.optimizer.chained_optimizers[0].optimizer.state.values())
    assert "--finetune: model weights from" in capsys.readouterr().out


def test_weights_loaded_without_optimizer_state_reach_its_main_copies(made, tmp_path,
                                                                     in_process, monkeypatch):
    """--finetune and --no_load_optim put the checkpoint's weights in the model after the
    optimizer was built. Its fp32 main copies (bf16/fp16, the distributed optimizer's
    shards: on a GPU) are refreshed from them, as Megatron-LM's load_checkpoint does;
    without that its first step wrote the initial weights back over the loaded ones. On
    CPU fp32 the copies are the weights themselves, so what is checked is the refresh,
    made once the loaded weights are in place."""
    from megatron.core.optimizer.optimizer import FP32Optimizer, MixedPrecisionOptimizer

    seen = []
    for cls in (FP32Optimizer, MixedPrecisionOptimizer):
        def spy(self, state_dict=None, _original=cls.reload_model_params):
            seen.append([p.detach().clone() for p in self.get_parameters()])
            return _original(self, state_dict)

        monkeypatch.setattr(cls, "reload_model_params", spy)
    tuned = in_process(**made["flags"], output_dir=str(tmp_path / "ft"), finetune=True,
                       load=os.path.join(made["good"], "checkpoint"))
    out = copy_run(made, tmp_path, "bare")
    resumed = in_process(**{**made["flags"], "train_iters": 3}, output_dir=out,
                         resume="auto", no_load_optim=True, no_load_rng=True)
    assert len(seen) == 2
    for trainer, refreshed_from in zip((tuned, resumed), seen):
        loaded = [p for g in trainer.optimizer.param_groups for p in g["params"]]
        assert len(loaded) == len(refreshed_from)
        assert all(torch.equal(a, b) for a, b in zip(loaded, refreshed_from))


def test_finetune_from_another_model_is_refused(made, tmp_path, in_process):
    with pytest.raises(CheckpointError, match="--hidden_size: checkpoint 64, now 128"):
        in_process(**{**made["flags"], "hidden_size": 128}, output_dir=str(tmp_path / "ft"),
                   finetune=True, load=os.path.join(made["good"], "checkpoint"))


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def reseal(folder):
    """What an attacker who can write the folder can do: rewrite the manifest too."""
    os.remove(os.path.join(folder, commit.MANIFEST_FILENAME))
    commit.seal(folder, extra={"id": "x", "parent_id": None})


def test_unsafe_pickle_in_metadata_is_refused(made, tmp_path, in_process):
    out = copy_run(made, tmp_path)
    marker = str(tmp_path / "pwned")
    with open(os.path.join(ckpt(out, 4), ".metadata"), "wb") as fh:
        pickle.dump(_Evil(marker), fh)
    reseal(ckpt(out, 4))
    expect_error(in_process, [".metadata: refusing to unpickle posix.system"], out,
                 **made["flags"], output_dir=out, resume="auto")
    assert not os.path.exists(marker)


def test_unsafe_pickle_in_common_pt_is_refused(made, tmp_path, in_process):
    out = copy_run(made, tmp_path)
    marker = str(tmp_path / "pwned")
    torch.save({"evil": _Evil(marker)}, os.path.join(ckpt(out, 4), "common.pt"))
    reseal(ckpt(out, 4))
    text = expect_error(in_process, ["common.pt: refusing to unpickle posix.system"], out,
                        **made["flags"], output_dir=out, resume="auto")
    assert "\n" not in text and "weights_only" not in text  # not torch's advice
    assert not os.path.exists(marker)


def test_checkpoint_before_the_first_step(made, tmp_path, in_process, capsys):
    """Adam creates its state on the first step; a checkpoint saved before it has none."""
    out = str(tmp_path / "early")
    first = in_process(**made["flags"], output_dir=out)
    assert first.save_checkpoint().endswith("iter_0000000")
    again = in_process(**made["flags"], output_dir=out, resume="auto")
    assert again.state.iteration == 0
    assert "optimizer (not yet stepped: empty)" in capsys.readouterr().out


def test_failed_save_changes_nothing_visible(made, tmp_path, in_process, monkeypatch):
    """A save that fails half-way (here: a full disk while writing the RNG files) raises
    one clear error; its staging folder is removed, and the tracker and the existing
    checkpoints are untouched. A save the disk clearly has no room for is refused before
    anything is written."""
    from swift_mcore.checkpointing import rng, space

    out = copy_run(made, tmp_path)
    trainer = in_process(**made["flags"], output_dir=out, resume="auto")
    root = os.path.join(out, "checkpoint")
    before = H.tree_snapshot(root)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rng, "save", full_disk)
    trainer.state.iteration = 5
    with pytest.raises(CheckpointError) as failed:
        trainer.save_checkpoint()
    text = str(failed.value)
    assert f"saving checkpoint iteration 5 failed: out of disk space in {root}" in text
    assert "No space left on device" in text and "needs about" in text
    assert ("The partial save was removed; latest_checkpointed_iteration.txt still names "
            "iteration 4") in text
    assert "\n" not in text
    assert H.tree_snapshot(root) == before  # no staging folder left either

    monkeypatch.undo()
    monkeypatch.setattr(space, "free_bytes", lambda path: 1000)
    with pytest.raises(space.DiskSpaceError,
                       match=f"not enough disk space to save checkpoint iteration 5 in {root}: "
                             f"it needs about [0-9,]+ bytes .*, 1,000 bytes .* are free. "
                             f"Nothing was written; latest_checkpointed_iteration.txt still names "
                             f"iteration 4"):
        trainer.save_checkpoint()
    assert H.tree_snapshot(root) == before
    monkeypatch.undo()
    assert trainer.save_checkpoint().endswith("iter_0000005")
    assert not any(name.startswith(".") for name in os.listdir(root))
