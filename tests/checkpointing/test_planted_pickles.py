"""Planted pickles and garbage in every file of a checkpoint, for pt --resume, pt --load
--finetune, export --to_hf and infer: nothing planted ever runs (its marker file never
appears), each is refused before any work with one line on stderr naming the file and the
refused type (never torch's advice to load with weights_only=False), exit code 2, nothing
on disk changed. The manifest is re-sealed after each tamper, so the file passes its
checksum and reaches the unpickler itself.

Also: export and infer warn (as pt does) when the latest-iteration file's checkpoint is damaged and
they fall back to an older one, and a tracker of binary garbage falls back too.

The checkpoint comes from one tiny training subprocess; the refusals run the command line
in this process (cli.main, on a one-rank gloo group), a few in real subprocesses."""

import argparse
import io
import os
import pickle
import shutil
import signal
import subprocess
import sys
import types

import pytest

import ckpt_harness as H
import tamper as T
from run_helpers import ROOT, TINY, run_pt
from swift_mcore.checkpointing import locate, safe_load
from swift_mcore.checkpointing.folders import LATEST_FILENAME, read_latest
from swift_mcore.errors import CheckpointError

SYSTEM = f"{os.system.__module__}.system"  # posix.system


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A pt run saved at iterations 2 and 4 (the tracker names 4)."""
    out = tmp_path_factory.mktemp("planted") / "run"
    run_pt(out, "--train_iters", "4", "--save_steps", "2")
    return str(out)


@pytest.fixture(autouse=True)
def _signal_handlers():
    """A command that got past loading would install the trainer's SIGTERM/SIGINT handlers
    in this process (and the test fails); put the handlers back either way."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def copy_run(made, tmp_path, name="run"):
    out = str(tmp_path / name)
    shutil.copytree(made, out)
    return out


def ckpt(out, iteration=4):
    return os.path.join(out, "checkpoint", f"iter_{iteration:07d}")


# ---- what is planted: case -> plant(folder, marker) returning what the error must name ----
def _distcp(prefix, payload):
    """A model item (finetune, export and infer load no optimizer state)."""
    def plant(folder, marker):
        fqn, file = T.replace_item(folder, prefix, payload(marker))
        return [file, fqn, f"refusing to unpickle {SYSTEM}"]
    return plant


def _file(name, data, *expected):
    def plant(folder, marker):
        T.write(folder, name, data(marker) if callable(data) else data)
        return [name, *expected]
    return plant


PICKLES = {
    # an _extra_state-like pickled object inside a .distcp file (torch.save'd)
    "distcp_extra_state": _distcp("decoder.layers.self_attention.linear_proj._extra_state",
                                  lambda m: T.torch_saved(T.Evil(m))),
    # a tensor's bytes replaced by a pickled object
    "distcp_tensor": _distcp("decoder.final_layernorm.weight",
                             lambda m: T.torch_saved(T.Evil(m))),
    # a plain (not torch.save) pickle as an item
    "distcp_plain_pickle": _distcp("decoder.layers.mlp.linear_fc1._extra_state",
                                   lambda m: pickle.dumps(T.Evil(m), 2)),
    ".metadata": _file(".metadata", lambda m: pickle.dumps(T.Evil(m)),
                       f"refusing to unpickle {SYSTEM}"),
    "common.pt": _file("common.pt", lambda m: T.torch_saved({"iteration": 4, "x": T.Evil(m)}),
                       f"refusing to unpickle {SYSTEM}"),
    # registered as safe by megatron-core, but not on swift-mcore's allow-list (common.pt
    # admits argparse.Namespace, for Megatron-LM's args, and nothing else of megatron's list)
    "common.pt_namespace": _file("common.pt",
                                 lambda m: T.torch_saved({"iteration": 4,
                                                          "x": types.SimpleNamespace(a=1)}),
                                 "refusing to unpickle types.SimpleNamespace"),
    # Megatron-LM's args Namespace holding a planted callable
    "common.pt_args": _file("common.pt",
                            lambda m: T.torch_saved({"iteration": 4,
                                                     "args": argparse.Namespace(seed=T.Evil(m))}),
                            f"refusing to unpickle {SYSTEM}"),
}
JSON_READ_BY_ALL = {
    "args.json": _file("args.json", T.GARBAGE, "unreadable"),
    "args.json_list": _file("args.json", b"[1, 2]", "not an object"),
    "metadata.json": _file("metadata.json", T.GARBAGE, "no readable metadata.json"),
}
JSON_READ_BY_RESUME = {
    "train_state.json": _file("train_state.json", T.GARBAGE, "unreadable"),
    "run.json": _file("run.json", T.GARBAGE, "unreadable"),
    "rng.json": _file("rng/rank_00000.json", T.GARBAGE, "RNG state of rank 0"),
}
CASES = {**PICKLES, **JSON_READ_BY_ALL, **JSON_READ_BY_RESUME}


def argv(command, out, tmp_path):
    train = [*TINY, "--train_iters", "4"]
    return {
        "pt_resume": ["pt", *train, "--output_dir", out, "--resume"],
        "pt_finetune": ["pt", *train, "--output_dir", str(tmp_path / "ft"), "--finetune",
                        "--load", os.path.join(out, "checkpoint")],
        "export": ["export", "--to_hf", "--model", out, "--output_dir", str(tmp_path / "hf")],
        "infer": ["infer", "--model", out, "--prompt", "hello", "--max_new_tokens", "2"],
    }[command]


MATRIX = ([("pt_resume", case) for case in CASES]
          + [(command, case) for command in ("pt_finetune", "export", "infer")
             for case in [*PICKLES, *JSON_READ_BY_ALL] if case != "distcp_plain_pickle"])


def assert_one_line_error(err, command, parts):
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"swift-mcore {command}: error: "), err
    for part in parts:
        assert part in lines[0], lines[0]
    assert "Traceback" not in err and "weights_only" not in err, err


@pytest.mark.parametrize("command,case", MATRIX, ids=[f"{c}-{k}" for c, k in MATRIX])
def test_planted_file_is_refused(made, tmp_path, gloo_group, capsys, command, case):
    from swift_mcore.cli import main

    out = copy_run(made, tmp_path)
    folder = ckpt(out)
    marker = tmp_path / "PLANTED_CODE_RAN"
    expected = CASES[case](folder, str(marker))
    T.reseal(folder)
    before = H.tree_snapshot(out)
    capsys.readouterr()
    code = main(argv(command, out, tmp_path))
    err = capsys.readouterr().err
    assert code == 2, err
    assert_one_line_error(err, command.split("_")[0], [folder, *expected])
    assert not marker.exists(), "the planted pickle ran"
    assert H.tree_snapshot(out) == before, "the refused command changed the run's files"
    assert not (tmp_path / "hf").exists()


def run_cli(*args, timeout=240):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONWARNINGS"] = "ignore"  # (this module's gloo group holds MASTER_PORT)
    return subprocess.run([sys.executable, "-m", "swift_mcore", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
                          stdin=subprocess.DEVNULL)


def test_refusals_from_real_processes(made, tmp_path):
    """The same refusals end the process with exit code 2 and no traceback."""
    out = copy_run(made, tmp_path)
    marker = tmp_path / "PLANTED_CODE_RAN"
    expected = PICKLES["distcp_extra_state"](ckpt(out), str(marker))
    T.reseal(ckpt(out))
    proc = run_cli("infer", "--model", out, "--prompt", "hello", "--max_new_tokens", 2)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert_one_line_error(proc.stderr, "infer", expected)
    assert proc.stdout == ""
    out = copy_run(made, tmp_path, "run2")
    T.write(ckpt(out), "common.pt", T.torch_saved({"x": T.Evil(str(marker))}))
    T.reseal(ckpt(out))
    proc = run_cli("pt", *TINY, "--train_iters", 4, "--output_dir", out, "--resume")
    assert proc.returncode == 2, proc.stderr[-3000:]
    # torch's DCP traceback text would be here if the reader's error were not unwrapped
    assert_one_line_error(proc.stderr, "pt", ["common.pt", f"refusing to unpickle {SYSTEM}"])
    assert not marker.exists()


def test_export_and_infer_warn_when_they_fall_back(made, tmp_path):
    """The latest-iteration file's checkpoint is damaged: export and infer use the newest complete
    one and say so, as pt --resume does (one place: locate.announce)."""
    out = copy_run(made, tmp_path)
    with open(os.path.join(ckpt(out), "__0_0.distcp"), "r+b") as fh:
        fh.truncate(100)
    proc = run_cli("export", "--to_hf", "--model", out, "--output_dir", tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"WARNING: {LATEST_FILENAME} names iteration 4, but {ckpt(out)} is not usable"
            in proc.stdout), proc.stdout
    assert f"falling back to the newest complete checkpoint {ckpt(out, 2)}" in proc.stdout
    assert f"loaded checkpoint {ckpt(out, 2)}" in proc.stdout

    # a tracker of binary garbage: the documented fallback, not a UnicodeDecodeError
    with open(os.path.join(out, "checkpoint", LATEST_FILENAME), "wb") as fh:
        fh.write(T.GARBAGE[128:160])
    proc = run_cli("infer", "--model", out, "--prompt", "hello", "--max_new_tokens", 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "WARNING:" in proc.stderr and "does not hold an iteration number (it holds " \
                                          "binary data" in proc.stderr, proc.stderr
    assert f"falling back to the newest complete checkpoint {ckpt(out, 2)}" in proc.stderr
    assert proc.stdout.startswith("hello")


def test_tracker_of_binary_garbage_is_unreadable_not_an_exception(tmp_path):
    root = tmp_path / "checkpoint"
    root.mkdir()
    (root / LATEST_FILENAME).write_bytes(b"\xff\xfe\x00garbage\x80")
    value, why = read_latest(str(root))
    assert value is None and "does not hold an iteration number" in why
    (root / LATEST_FILENAME).write_bytes(b"1" * 1000)
    assert read_latest(str(root))[0] is None
    (root / LATEST_FILENAME).write_bytes(b"12\n")
    assert read_latest(str(root)) == (12, None)
    with pytest.raises(CheckpointError, match="no other complete checkpoint"):
        (root / LATEST_FILENAME).write_bytes(b"\x80")
        locate.resolve("auto", str(root))


def test_the_torch_load_allow_list_is_explicit():
    """torch.load inside swift-mcore accepts torch's own tensor and container types and
    TORCH_LOAD_EXTRA, not what other libraries registered as safe (megatron-core registers
    argparse.Namespace and more at import); the registrations are put back afterwards."""
    import megatron.core  # noqa: F401  (registers its safe globals)
    import torch

    assert safe_load.TORCH_LOAD_EXTRA == (io.BytesIO,)
    registered = set(map(str, torch.serialization.get_safe_globals()))
    assert any("Namespace" in name for name in registered)
    good = {"w": torch.ones(2), "step": 3, "lr": 1e-3, "betas": (0.9, 0.95), "name": "x",
            "groups": [{"fused": True, "x": None}]}
    loaded = safe_load.torch_load(io.BytesIO(T.torch_saved(good)), "here")
    assert torch.equal(loaded["w"], good["w"]) and loaded["groups"] == good["groups"]
    assert isinstance(safe_load.torch_load(io.BytesIO(T.torch_saved(io.BytesIO(b"te"))),
                                           "here"), io.BytesIO)
    for obj, name in ((argparse.Namespace(a=1), "argparse.Namespace"),
                      (T.Evil("/nonexistent/marker"), SYSTEM)):
        with pytest.raises(CheckpointError) as info:
            safe_load.torch_load(io.BytesIO(T.torch_saved(obj)), "here")
        assert str(info.value).startswith(f"here: refusing to unpickle {name} ")
        assert "\n" not in str(info.value) and "weights_only" not in str(info.value)
    with pytest.raises(CheckpointError, match="here: not a readable torch.save file"):
        safe_load.torch_load(io.BytesIO(T.GARBAGE), "here")
    assert set(map(str, torch.serialization.get_safe_globals())) == registered
