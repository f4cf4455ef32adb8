"""A checkpoint whose facts stored twice disagree is refused wherever a checkpoint is picked
(pt --resume, pt --load --finetune, export, infer): one line naming the file, the two
values and what to do, exit code 2, nothing on disk changed. The facts: the iteration in the
folder's name, in train_state.json and in common.pt, and common.pt's sample counters (what
Megatron-LM's loader reads) against train_state.json's. Megatron-LM's checkpoints:
tests/checkpointing/test_megatron_lm.py.

The manifest is re-sealed after each change, so the files pass their checksums: the
disagreement itself is what is refused. The checkpoint comes from one tiny training
subprocess; the commands run in this process (cli.main, on a one-rank gloo group)."""

import argparse
import json
import os
import shutil
import signal

import pytest
import torch

import ckpt_harness as H
import tamper as T
from run_helpers import TINY, run_pt
from swift_mcore.checkpointing import locate, safe_load
from swift_mcore.checkpointing.folders import write_latest
from swift_mcore.errors import CheckpointError

GBS = 8  # run_helpers.TINY's global batch


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A pt run saved at iterations 2 and 4 (the tracker names 4)."""
    out = tmp_path_factory.mktemp("facts") / "run"
    run_pt(out, "--train_iters", "4", "--save_steps", "2")
    return str(out)


@pytest.fixture(autouse=True)
def _signal_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def ckpt(out, iteration):
    return os.path.join(out, "checkpoint", f"iter_{iteration:07d}")


def edit_json(folder, name, **values):
    path = os.path.join(folder, name)
    with open(path) as fh:
        data = json.load(fh)
    data.update(values)
    with open(path, "w") as fh:
        json.dump(data, fh)


def edit_common(folder, iteration=None, **args):
    path = os.path.join(folder, "common.pt")
    common = safe_load.torch_load(path, path, extra=safe_load.common_pt_extra())
    if iteration is not None:
        common["iteration"] = iteration
    common["args"] = argparse.Namespace(**{**vars(common["args"]), **args})
    torch.save(common, path)


# case -> change(run) returning what the one error line must name
def train_state_says_1000(out):
    folder = ckpt(out, 4)
    edit_json(folder, "train_state.json", iteration=1000)
    T.reseal(folder)
    return [f"{folder}/train_state.json says iteration 1000", "iter_0000004 (iteration 4)",
            "rename the folder iter_0001000"]


def folder_renamed(out):
    os.rename(ckpt(out, 4), ckpt(out, 6))
    write_latest(os.path.join(out, "checkpoint"), 6)
    return [f"{ckpt(out, 6)}/train_state.json says iteration 4", "iter_0000006 (iteration 6)"]


def common_pt_iteration(out):
    folder = ckpt(out, 4)
    edit_common(folder, iteration=5)
    T.reseal(folder)
    return [f"{folder}/common.pt says iteration 5", "train_state.json iteration 4",
            "different saves"]


def common_pt_samples(out):
    folder = ckpt(out, 4)
    edit_common(folder, consumed_train_samples=999)
    T.reseal(folder)
    return [f"{folder}/common.pt says consumed_train_samples 999",
            f"train_state.json {4 * GBS}"]


CASES = {f.__name__: f for f in (train_state_says_1000, folder_renamed, common_pt_iteration,
                                 common_pt_samples)}


def argv(command, out, tmp_path):
    train = [*TINY, "--train_iters", "6"]
    return {
        "pt_resume": (["pt", *train, "--output_dir", out, "--resume"], "--resume"),
        "pt_finetune": (["pt", *train, "--output_dir", str(tmp_path / "ft"), "--finetune",
                         "--load", os.path.join(out, "checkpoint")], "--load"),
        "export": (["export", "--to_hf", "--model", out, "--output_dir",
                    str(tmp_path / "hf")], "--model"),
        "infer": (["infer", "--model", out, "--prompt", "hello", "--max_new_tokens", "2"],
                  "--model"),
    }[command]


MATRIX = [(command, case) for case in CASES
          for command in ("pt_resume", "pt_finetune", "export", "infer")]


@pytest.mark.parametrize("command,case", MATRIX, ids=[f"{c}-{k}" for c, k in MATRIX])
def test_disagreeing_checkpoint_is_refused(made, tmp_path, gloo_group, capsys, command, case):
    from swift_mcore.cli import main

    out = str(tmp_path / "run")
    shutil.copytree(made, out)
    expected = CASES[case](out)
    before = H.tree_snapshot(out)
    args, flag = argv(command, out, tmp_path)
    capsys.readouterr()
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    name = command.split("_")[0]
    assert lines[0].startswith(f"swift-mcore {name}: error: "), err
    for part in [*expected, f"pass {flag} another checkpoint"]:
        assert part in lines[0], lines[0]
    assert H.tree_snapshot(out) == before, "the refused command changed the run's files"
    assert not (tmp_path / "hf").exists() and not (tmp_path / "ft").exists()


def test_agreeing_checkpoints_pass_under_any_name(made, tmp_path):
    """The folder's own name counts, not a link's (checkpoint/best -> iter_NNNNNNN), and a
    folder not named iter_NNNNNNN (a copy kept elsewhere) has only its files compared."""
    out = str(tmp_path / "run")
    shutil.copytree(made, out)
    for iteration in (2, 4):
        assert locate.resolve(ckpt(out, iteration), None, "--resume") == (
            ckpt(out, iteration), [])
    assert locate.resolve(out, None, "--resume") == (ckpt(out, 4), [])
    link = os.path.join(out, "checkpoint", "best")
    os.symlink("iter_0000002", link)
    assert locate.resolve(link, None, "--load") == (link, [])
    kept = str(tmp_path / "kept")
    shutil.copytree(ckpt(out, 4), kept)
    assert locate.resolve(kept, None, "--load") == (kept, [])
    edit_common(kept, iteration=3)
    T.reseal(kept)
    with pytest.raises(CheckpointError, match="common.pt says iteration 3"):
        locate.resolve(kept, None, "--load")
