"""Megatron-LM checkpoints in swift-mcore: the checkpoint in tests/fixtures/megatron_lm (written by
Megatron-LM's own save_checkpoint, see its README) resumes with its weights, optimizer,
scheduler and counters (logits and the next step's loss within 1e-5 of Megatron-LM's), loads
with --load --finetune, is never taken for a half-finished save, and a tampered common.pt runs
nothing."""

import json
import os
import shutil
import signal

import numpy as np
import pytest
import torch

import ckpt_harness as H
import tamper as T
from swift_mcore.arguments import RunArguments
from swift_mcore.checkpointing import safe_load
from swift_mcore.errors import CheckpointError

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "fixtures", "megatron_lm")
REFERENCE = os.path.join(FIXTURE, "reference")
# The fixture's model and run (its README's argv), in swift-mcore's flags.
FLAGS = dict(
    num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
    num_query_groups=2, seq_length=64, max_position_embeddings=64, vocab_size=511,
    untie_embeddings_and_output_weights=True, swiglu=True, normalization="RMSNorm",
    micro_batch_size=2, global_batch_size=8, lr=1e-3, min_lr=1e-4, lr_warmup_iters=2,
    lr_decay_style="linear", train_iters=20, weight_decay=0.01, seed=1234, clip_grad=1.0,
    adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
    hidden_dropout=0.0, attention_dropout=0.0, eval_steps=0, num_workers=0,
    tensorboard=False, plot=False, progress_bar=False, log_interval=1,
)



def read_pickled(path):
    """common.pt through the allow-list swift-mcore itself reads it with (safe_load)."""
    return safe_load.torch_load(path, path, extra=safe_load.common_pt_extra())


@pytest.fixture(scope="module")
def data_flags(tmp_path_factory):
    """A byte-level BPE of 300 tokens (the fixture's vocabulary is 511, padded to 512) and a
    small corpus: the data only has to exist, the checked batches are the fixture's."""
    from swift_mcore.data.tokenizer import train_bpe

    folder = tmp_path_factory.mktemp("mlm_data")
    corpus = H.write_corpus(str(folder / "corpus.jsonl"), n_docs=60, words=40)
    with open(corpus) as fh:
        docs = [json.loads(line)["text"] for line in fh]
    path = str(folder / "tokenizer.json")
    train_bpe(docs, vocab_size=300).save(path)
    return {"tokenizer": path, "dataset": [corpus], "split": "90,10,0"}


@pytest.fixture
def mlm_root(tmp_path):
    root = tmp_path / "mlm_run"
    shutil.copytree(FIXTURE, root, ignore=shutil.ignore_patterns("reference", "README.md"))
    return str(root)


@pytest.fixture
def in_process(trainer_setup, data_flags):
    """Trainer.setup here (conftest.trainer_setup) with the fixture's flags."""
    return lambda **flags: trainer_setup(**{**FLAGS, **data_flags, **flags})


def logits(trainer):
    ids = torch.from_numpy(np.load(os.path.join(REFERENCE, "input_ids.npy")))
    model = trainer.model[0]
    model.eval()
    mask = torch.tril(torch.ones(64, 64)).unsqueeze(0).unsqueeze(0).expand(2, 1, 64, 64) < 0.5
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=torch.arange(64).expand(2, 64),
                    attention_mask=mask)
    model.train()
    return out.float().numpy()


def next_step_batches():
    with open(os.path.join(REFERENCE, "next_step.json")) as fh:
        ref = json.load(fh)
    text = torch.tensor(ref["batch"]["text_token_ids"], dtype=torch.int64)
    batches = []
    for m in range(4):
        rows = text[2 * m:2 * m + 2]
        batches.append({"tokens": rows[:, :-1], "labels": rows[:, 1:],
                        "loss_mask": torch.ones(2, 64), "position_ids": torch.arange(64).expand(2, 64),
                        "sample_ids": torch.arange(2 * m, 2 * m + 2)})
    return ref, iter(batches)


def param_stats(trainer):
    from swift_mcore.runtime.ddp import unwrap

    return {name: (p.detach().double().sum().item(), p.detach().double().norm().item())
            for name, p in unwrap(trainer.model[0]).named_parameters()}


def test_resume_megatron_lm_checkpoint(in_process, tmp_path, mlm_root, capsys):
    """--resume ROOT (the tracker names iteration 10): counters, weights (logits), optimizer
    and scheduler (the next step's loss, lr and every parameter after the Adam update) are
    Megatron-LM's within 1e-5; what is not restored is named in the log."""
    trainer = in_process(output_dir=str(tmp_path / "out"), resume=mlm_root)
    log = capsys.readouterr().out
    folder = os.path.join(mlm_root, "iter_0000010")
    assert f"resumed from {folder} (a Megatron-LM checkpoint): iteration 10, 80 train samples" \
        in log and "restored model, optimizer, LR scheduler (step 10, lr 0.0006), RNG" in log
    assert ("RNG states: python, numpy, torch from Megatron-LM's rng_state; its CUDA and "
            "tracker streams not (no CUDA") in log
    # the generators hold Megatron-LM's saved states (nothing drew from them since)
    import random

    _, [[saved]] = raw_rng_state(folder)
    assert random.getstate() == saved["random_rng_state"]
    np_now, np_saved = np.random.get_state(), saved["np_rng_state"]
    assert np_now[0] == np_saved[0] and np.array_equal(np_now[1], np_saved[1])
    assert np_now[2:] == np_saved[2:]
    assert torch.equal(torch.get_rng_state(), saved["torch_rng_state"])
    assert "NOT checked against the Megatron-LM checkpoint: the training data" in log
    s = trainer.state
    assert (s.iteration, s.consumed_train_samples, s.consumed_valid_samples,
            s.skipped_train_samples) == (10, 80, 0, 0)
    assert s.floating_point_operations_so_far == 3523215360.0
    assert trainer.scheduler.num_steps == 10
    np.testing.assert_allclose(logits(trainer),
                               np.load(os.path.join(REFERENCE, "logits_iter10.npy")),
                               rtol=0, atol=1e-5)

    ref, trainer.train_iterator = next_step_batches()
    step = trainer.train_step()
    assert abs(step["loss"] - ref["loss"]) < 1e-5
    assert abs(step["grad_norm"] - ref["grad_norm"]) < 1e-5
    assert step["lr"] == pytest.approx(ref["lr"], rel=1e-12)  # the rate this step used
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(
        ref["lr_after_scheduler_step"], rel=1e-12)
    stats = param_stats(trainer)
    for name, want in ref["param_stats_after_update"].items():
        got_sum, got_l2 = stats[name]
        assert abs(got_l2 - want["l2"]) <= 1e-5 * max(1.0, abs(want["l2"])), name
        assert abs(got_sum - want["sum"]) <= 1e-5 * max(1.0, abs(want["sum"])), name


def test_finetune_from_megatron_lm_iter_folder(in_process, tmp_path, mlm_root, capsys):
    """--load ITER_FOLDER --finetune: the weights only; counters, optimizer and schedule fresh."""
    folder = os.path.join(mlm_root, "iter_0000010")
    trainer = in_process(output_dir=str(tmp_path / "ft"), load=folder, finetune=True)
    assert f"--finetune: model weights from {folder}" in capsys.readouterr().out
    assert trainer.state.iteration == 0 and trainer.scheduler.num_steps == 0
    np.testing.assert_allclose(logits(trainer),
                               np.load(os.path.join(REFERENCE, "logits_iter10.npy")),
                               rtol=0, atol=1e-5)


def test_a_megatron_lm_checkpoint_is_not_a_half_finished_save(mlm_root):
    """Recognised as Megatron-LM's, complete; a truncated .distcp is named as such."""
    from swift_mcore.checkpointing import locate, megatron_lm

    folder = os.path.join(mlm_root, "iter_0000010")
    assert megatron_lm.is_megatron_lm(folder)
    for spec in (mlm_root, folder):
        assert locate.resolve(spec, None, "--resume") == (folder, [])
    data = os.path.join(folder, "__0_1.distcp")
    with open(data, "r+b") as fh:
        fh.truncate(os.path.getsize(data) // 2)
    with pytest.raises(CheckpointError) as info:
        locate.resolve(folder, None, "--resume")
    text = str(info.value)
    assert "Megatron-LM checkpoint whose __0_1.distcp has" in text and "truncated" in text
    assert "manifest" not in text


@pytest.mark.parametrize("command", ["resume", "finetune"])
def test_folder_named_for_another_iteration_is_refused(in_process, tmp_path, mlm_root,
                                                        command):
    """common.pt says iteration 10, the folder (and the tracker) 6: refused, naming both,
    before anything is loaded or written (checkpointing/consistency.py)."""
    from swift_mcore.checkpointing.folders import write_latest

    folder = os.path.join(mlm_root, "iter_0000006")
    os.rename(os.path.join(mlm_root, "iter_0000010"), folder)
    write_latest(mlm_root, 6)
    before = H.tree_snapshot(mlm_root)
    flags, flag = (({"resume": mlm_root}, "--resume") if command == "resume"
                   else ({"load": folder, "finetune": True}, "--load"))
    with pytest.raises(CheckpointError) as info:
        in_process(output_dir=str(tmp_path / "out"), **flags)
    text = str(info.value)
    for part in (f"{folder}/common.pt says iteration 10 but its folder is iter_0000006 "
                 f"(iteration 6)", "rename the folder iter_0000010",
                 f"pass {flag} another checkpoint"):
        assert part in text, text
    assert "\n" not in text
    assert H.tree_snapshot(mlm_root) == before


@pytest.mark.parametrize("command", ["resume", "finetune"])
def test_tampered_common_pt_runs_nothing(in_process, tmp_path, mlm_root, command):
    """common.pt's Namespace may hold only plain values: a planted callable is refused by
    name before it is built, whether the run resumes or finetunes."""
    import argparse

    folder = os.path.join(mlm_root, "iter_0000010")
    common = read_pickled(os.path.join(folder, "common.pt"))
    marker = tmp_path / "PLANTED_CODE_RAN"
    common["args"] = argparse.Namespace(**{**vars(common["args"]), "seed": T.Evil(str(marker))})
    torch.save(common, os.path.join(folder, "common.pt"))
    flags = ({"resume": mlm_root} if command == "resume"
             else {"load": folder, "finetune": True})
    with pytest.raises(CheckpointError) as info:
        in_process(output_dir=str(tmp_path / "out"), **flags)
    assert f"{folder}: common.pt: refusing to unpickle {os.system.__module__}.system" \
        in str(info.value)
    assert not marker.exists(), "the planted pickle ran"


def test_tampered_rng_state_runs_nothing(in_process, tmp_path, mlm_root):
    """rng_state may hold numpy's uint32 state array besides torch's types; a planted
    callable is refused naming the item and the type."""
    folder = os.path.join(mlm_root, "iter_0000010")
    marker = tmp_path / "PLANTED_CODE_RAN"
    fqn, file = T.replace_item(folder, "rng_state",
                               T.torch_saved([[{"random_rng_state": T.Evil(str(marker))}]]))
    with pytest.raises(CheckpointError) as info:
        in_process(output_dir=str(tmp_path / "out"), resume=mlm_root)
    text = str(info.value)
    assert f"{file} (item {fqn} at byte" in text
    assert f"refusing to unpickle {os.system.__module__}.system" in text
    assert not marker.exists(), "the planted pickle ran"


# ---- the other way: what Megatron-LM's load_checkpoint asks of a swift-mcore checkpoint ----
# Read from the fixture (the same model, saved by Megatron-LM): .metadata's keys, common.pt's
# keys, the args fields its loader reads (check_checkpoint_args, the sample counters, the
# saved-or-not flags), the layout of rng_state.
ARGS_READ_BY_MEGATRON_LM = (
    "num_layers", "hidden_size", "num_attention_heads", "add_position_embedding",
    "max_position_embeddings", "make_vocab_size_divisible_by", "padded_vocab_size",
    "tokenizer_type", "data_parallel_random_init", "tensor_model_parallel_size",
    "pipeline_model_parallel_size", "consumed_train_samples", "skipped_train_samples",
    "consumed_valid_samples", "no_save_rng", "no_save_optim", "use_distributed_optimizer",
    "ckpt_format")
SAME_RUN = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
            "num_query_groups", "kv_channels", "seq_length", "max_position_embeddings",
            "padded_vocab_size", "make_vocab_size_divisible_by", "add_position_embedding",
            "position_embedding_type", "normalization", "swiglu",
            "untie_embeddings_and_output_weights", "add_bias_linear",
            "tensor_model_parallel_size", "pipeline_model_parallel_size", "micro_batch_size",
            "global_batch_size", "seed", "data_parallel_random_init", "no_save_rng",
            "no_save_optim", "use_distributed_optimizer", "ckpt_format")


def dcp_keys(folder):
    from swift_mcore.checkpointing.safe_load import read_dcp_metadata

    return set(read_dcp_metadata(folder).state_dict_metadata)


def pickled_globals(path):
    """The classes and functions common.pt's pickle names (without unpickling it)."""
    import pickletools
    import zipfile

    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            found.add(".".join(strings[-2:]))
        elif op.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
    return found


def raw_rng_state(folder):
    """The rng_state object as Megatron-LM's loader gets it (test code: a plain DCP read)."""
    import torch.distributed.checkpoint as dcp

    [key] = [k for k in dcp_keys(folder) if k.startswith("rng_state/")]
    state = {key: None}
    from torch.distributed.checkpoint import FileSystemReader

    import io
    holder = {}

    class Planner(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            holder[read_item.dest_index.fqn] = safe_load.torch_load(
                value, "rng_state", extra=safe_load.rng_state_extra())

    dcp.load({key: io.BytesIO()}, storage_reader=FileSystemReader(folder), planner=Planner(),
             no_dist=True)
    return key, holder[key]


@pytest.fixture(scope="module")
def saved_by_swift(gloo_group, data_flags, tmp_path_factory):
    """The fixture's model and flags in swift-mcore, stopped and saved at iteration 2."""
    from swift_mcore.training.trainer import Trainer

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    out = tmp_path_factory.mktemp("swift_run") / "out"
    trainer = Trainer(RunArguments.from_flags(**{**FLAGS, **data_flags, "exit_interval": 2,
                                                      "output_dir": str(out)}))
    trainer.train()
    for s, handler in saved.items():
        signal.signal(s, handler)
    return str(out / "checkpoint" / "iter_0000002"), trainer


def test_swift_checkpoint_has_what_megatron_lm_loads(saved_by_swift):
    ours, theirs = saved_by_swift[0], os.path.join(FIXTURE, "iter_0000010")
    # every sharded key, rng_state/shard_0.0_1.1 included, named as Megatron-LM names it
    assert dcp_keys(ours) == dcp_keys(theirs)
    with open(os.path.join(ours, "metadata.json")) as a, \
            open(os.path.join(theirs, "metadata.json")) as b:
        assert json.load(a) == json.load(b)
    mine = read_pickled(os.path.join(ours, "common.pt"))
    ref = read_pickled(os.path.join(theirs, "common.pt"))
    assert set(ref) <= set(mine)
    assert mine["content_metadata"] == ref["content_metadata"]
    assert mine["checkpoint_version"] == ref["checkpoint_version"] and mine["iteration"] == 2
    assert set(mine["optimizer"]["state"]) == set(ref["optimizer"]["state"])
    assert [set(g) for g in mine["optimizer"]["param_groups"]] == \
        [set(g) for g in ref["optimizer"]["param_groups"]]
    # the scheduler in Megatron-LM's units (samples): its loader asserts these are its own
    sched = dict(ref["opt_param_scheduler"], num_steps=2 * 8)
    assert mine["opt_param_scheduler"] == sched
    # args: a Namespace of plain values only (no megatron class is pickled)
    args, ref_args = mine["args"], ref["args"]
    for name in ARGS_READ_BY_MEGATRON_LM:
        assert hasattr(args, name), name
    for name in SAME_RUN:
        assert getattr(args, name) == getattr(ref_args, name), name
    assert (args.consumed_train_samples, args.skipped_train_samples,
            args.consumed_valid_samples) == (16, 0, 0)
    for value in vars(args).values():
        assert value is None or isinstance(value, (bool, int, float, str, list)), value
    assert pickled_globals(os.path.join(ours, "common.pt")) <= {
        "argparse.Namespace", "collections.OrderedDict", "torch._utils._rebuild_tensor_v2",
        "torch.FloatStorage"}
    # rng_state: the same key, structure, types and sizes as Megatron-LM's
    key, rng = raw_rng_state(ours)
    ref_key, ref_rng = raw_rng_state(theirs)
    assert key == ref_key == "rng_state/shard_0.0_1.1"
    [[state]], [[ref_state]] = rng, ref_rng
    assert set(state) == set(ref_state)
    assert set(state["rng_tracker_states"]) == set(ref_state["rng_tracker_states"])
    for name in ("torch_rng_state", "cuda_rng_state"):
        assert state[name].dtype == torch.uint8 and state[name].shape == ref_state[name].shape
    for name, t in ref_state["rng_tracker_states"].items():
        assert torch.equal(state["rng_tracker_states"][name], t), name  # same seed 1234
    assert type(state["np_rng_state"][1]) is np.ndarray


@pytest.mark.parametrize("layout", ["megatron_lm", "before"])
def test_swift_checkpoint_resumes_in_swift(in_process, saved_by_swift, tmp_path, capsys,
                                           layout):
    """Our own resume reads the Megatron-LM-layout common.pt (Namespace, samples) back, and
    a checkpoint of the layout before (scheduler in iterations, no args, no content metadata,
    no scheduler_unit in run.json) still resumes the same."""
    out = os.path.dirname(os.path.dirname(saved_by_swift[0]))
    run = str(tmp_path / "run")
    shutil.copytree(out, run, ignore=shutil.ignore_patterns("data_cache", ".run.lock"))
    folder = os.path.join(run, "checkpoint", "iter_0000002")
    if layout == "before":
        path = os.path.join(folder, "common.pt")
        common = read_pickled(path)
        for key in ("args", "content_metadata"):
            del common[key]
        common["opt_param_scheduler"] = {
            k: v // 8 if k in ("num_steps", "lr_warmup_steps", "lr_decay_steps",
                               "wd_incr_steps") else v
            for k, v in common["opt_param_scheduler"].items()}
        torch.save(common, path)
        with open(os.path.join(folder, "run.json")) as fh:
            run_json = json.load(fh)
        del run_json["scheduler_unit"]
        with open(os.path.join(folder, "run.json"), "w") as fh:
            json.dump(run_json, fh)
        T.reseal(folder)
    trainer = in_process(output_dir=run, resume="auto")
    assert trainer.state.iteration == 2 and trainer.scheduler.num_steps == 2
    assert trainer.scheduler.lr_warmup_steps == 2 and trainer.scheduler.lr_decay_steps == 20
    assert "restored model, optimizer, LR scheduler (step 2, lr 0.001)" in \
        capsys.readouterr().out


def test_megatron_lm_style_load_of_a_swift_checkpoint(saved_by_swift):
    """The state dict Megatron-LM's load_checkpoint builds (generate_state_dict: model and
    optimizer with the checkpoint's content metadata, rng_state as a (PP, TP) ShardedObject),
    loaded by megatron-core's own loader with Megatron-LM's default strictness: nothing is
    missing, and what comes back is what was saved."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from swift_mcore.runtime.ddp import unwrap

    folder, trainer = saved_by_swift
    metadata = dist_checkpointing.load_content_metadata(folder)
    assert metadata == {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    model = unwrap(trainer.model[0])
    state = {"model": model.sharded_state_dict(metadata=metadata)}
    state["optimizer"] = trainer.optimizer.sharded_state_dict(state, is_loading=True,
                                                              metadata=metadata)
    state["rng_state"] = ShardedObject("rng_state", None, (1, 1), (0, 0), replica_id=0)
    state["opt_param_scheduler"] = trainer.scheduler.state_dict()
    loaded = dist_checkpointing.load(state, folder, strict="assume_ok_unexpected")
    assert loaded["iteration"] == 2 and loaded["args"].consumed_train_samples == 16
    for name, tensor in model.state_dict().items():
        if not name.endswith("_extra_state"):
            assert torch.equal(loaded["model"][name], tensor), name
    [rng] = loaded["rng_state"]
    assert isinstance(rng["random_rng_state"], tuple) and rng["cuda_rng_state"].numel() == 16
