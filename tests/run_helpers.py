"""Runs `swift-mcore pt` and `sft` in subprocesses (one rank or torchrun) and reads what it wrote."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def child_env(**extra: str) -> Dict[str, str]:
    """os.environ for a command started from a test, without the launch variables: a
    module's in-process gloo group (conftest.gloo_group) sets MASTER_ADDR/PORT and holds
    that port, which a one-rank child would then try to bind."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env.update(extra)
    return env

# A model small enough that a run of a few iterations costs seconds on 2 cores.
TINY = ["--num_layers", "2", "--hidden_size", "64", "--num_attention_heads", "4",
        "--num_query_groups", "2", "--seq_length", "32", "--micro_batch_size", "2",
        "--global_batch_size", "8", "--lr", "1e-3", "--lr_warmup_iters", "0",
        "--lr_decay_style", "constant", "--min_lr", "1e-3", "--log_interval", "1",
        "--eval_steps", "0", "--progress_bar", "false", "--tensorboard", "false",
        "--plot", "false", "--num_workers", "0"]


def run_pt(output_dir, *flags, nproc: int = 1, timeout: int = 240, check: bool = True,
           env: Dict[str, str] | None = None, torchrun: bool = False, command: str = "pt"
           ) -> subprocess.CompletedProcess:
    """NPROC_PER_NODE=nproc swift-mcore pt ..., or torchrun -m swift_mcore pt ... ."""
    launcher = [sys.executable, "-m", "swift_mcore"]
    full_env = child_env(**(env or {}))
    if torchrun:
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                    f"--master_port={free_port()}", "-m", "swift_mcore"]
    elif nproc > 1:
        full_env["NPROC_PER_NODE"] = str(nproc)
        full_env["MASTER_PORT"] = str(free_port())
    cmd = [*launcher, command, *TINY, "--output_dir", str(output_dir), *map(str, flags)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env,
                          cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"swift-mcore {command} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def run_sft(output_dir, *flags, **kwargs) -> subprocess.CompletedProcess:
    """swift-mcore sft with the TINY model (the data flags come from the caller)."""
    return run_pt(output_dir, *flags, command="sft", **kwargs)


def short_conversations(path, words: List[str], rows: int = 24, seed: int = 5) -> Path:
    """A jsonl of ``rows`` conversations of one or two short user/assistant turns: packed
    rows of 64 tokens hold several, so their boundaries fall inside a row."""
    import random

    rng = random.Random(seed)
    with open(path, "w") as fh:
        for _ in range(rows):
            messages = []
            for _ in range(rng.randint(1, 2)):
                messages += [{"role": role, "content": " ".join(
                    rng.choice(words) for _ in range(rng.randint(1, 7)))}
                    for role in ("user", "assistant")]
            fh.write(json.dumps({"messages": messages}) + "\n")
    return Path(path)


def one_turn_conversations(path, words: List[str], rows: int = 24, seed: int = 3) -> Path:
    """A jsonl of ``rows`` one-turn conversations of 1 to 9 words a message: rows of very
    different lengths, padded to a common width in a micro-batch."""
    import random

    rng = random.Random(seed)
    Path(path).write_text("".join(json.dumps({"messages": [
        {"role": role, "content": " ".join(rng.choice(words)
                                           for _ in range(rng.randint(1, 9)))}
        for role in ("user", "assistant")]}) + "\n" for _ in range(rows)))
    return Path(path)


def checkpoint_tensors(folder, scratch, keep) -> dict:
    """The tensors of a distributed checkpoint folder (model, optimizer, RNG state) for which
    ``keep(name, tensor)`` holds, by dotted name; read through the safe loader."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from swift_mcore.checkpointing import safe_load

    folder = Path(folder)
    flat = str(Path(scratch) / f"{folder.parent.parent.name}_{folder.name}.pt")
    dcp_to_torch_save(str(folder), flat)
    found = {}

    def walk(d, prefix=""):
        for key, value in d.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif torch.is_tensor(value) and keep(prefix + str(key), value):
                found[prefix + str(key)] = value

    walk(safe_load.torch_load(flat, flat, extra=safe_load.common_pt_extra()
                              + safe_load.rng_state_extra()))
    return found


def check_layout_resumes_and_reshards(tmp_path, shape, layout, timeout: int = 900) -> str:
    """`pt` with ``shape`` on one rank (a checkpoint every iteration) against the same run
    on two ranks in ``layout`` started from its iteration-1 checkpoint: the one-rank losses
    within 1e-5; the layout's iteration-2 checkpoint resumed in the layout gives its own
    losses bit for bit, and continued at one rank its losses within 1e-5. Returns the
    layout run's stdout."""
    one, laid = Path(tmp_path) / "one", Path(tmp_path) / "layout"
    run_pt(one, *shape, "--save_steps", "1")
    proc = run_pt(laid, *shape, *layout, "--save_steps", "2",
                  "--resume", one / "checkpoint" / "iter_0000001", nproc=2, timeout=timeout)
    ref, got = losses(one), losses(laid)
    assert sorted(got) == [2, 3, 4]
    for it in got:
        assert abs(got[it] - ref[it]) <= 1e-5, (it, got[it], ref[it])
    saved = laid / "checkpoint" / "iter_0000002"
    run_pt(Path(tmp_path) / "again", *shape, *layout, "--no_save", "--resume", saved,
           nproc=2, timeout=timeout)
    again = losses(Path(tmp_path) / "again")
    assert sorted(again) == [3, 4] and all(again[it] == got[it] for it in again), again
    run_pt(Path(tmp_path) / "flat", *shape, "--no_save", "--resume", saved)
    flat = losses(Path(tmp_path) / "flat")
    assert sorted(flat) == [3, 4]
    for it in flat:
        assert abs(flat[it] - got[it]) <= 1e-5, (it, flat[it], got[it])
    return proc.stdout


def train_records(output_dir) -> List[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["split"] == "train"]


def losses(output_dir) -> Dict[int, float]:
    return {r["iteration"]: r["loss"] for r in train_records(output_dir)}


def free_port() -> int:
    """A local TCP port nothing listens on, for a launcher to bind a moment later. Drawn
    below the kernel's ephemeral range (ip_local_port_range, 32768 and up here), which a
    port-0 bind would return: outgoing connections (gloo's, other tests') take their ports
    from that range and could take this one before the launcher binds it."""
    import random
    import socket

    rng = random.SystemRandom()
    while True:
        port = rng.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def replace_tokens(prefix, in_place=False):
    """Reverse the first 64 tokens: same documents, same lengths, same .idx, other tokens."""
    import numpy as np

    from swift_mcore.data import indexed

    if in_place:
        data = np.memmap(prefix + ".bin", dtype=np.uint16, mode="r+")
        assert not np.array_equal(data[:64], data[:64][::-1])
        data[:64] = data[:64][::-1].copy()
        data.flush()
        del data
        return
    docs = read_documents(prefix)
    tokens = np.array([t for d in docs for t in d], dtype=np.uint16)
    tokens[:64] = tokens[:64][::-1].copy()
    with indexed.IndexedWriter(prefix, np.uint16) as writer:
        writer.add_documents(tokens, np.array([len(d) for d in docs]))
        writer.commit()


def read_documents(prefix: str):
    """Every document's token ids of a small .bin/.idx pair; None if the pair is missing."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from swift_mcore.data import indexed

    if not indexed.exists(prefix):
        return None
    dataset = IndexedDataset(prefix)  # held while copying: its arrays are views of its mmap
    return [dataset[i].tolist() for i in range(len(dataset))]


def run_or_kill(argv, timeout: float, **popen) -> Optional[subprocess.CompletedProcess]:
    """``argv`` in a session of its own (text output captured); None when it still runs after
    ``timeout`` s, its whole process group killed first, so a regression that blocks (on a
    FIFO, say) fails the test instead of hanging pytest."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.communicate()
        return None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every process below it: torchrun's agent and its
    ranks each run in a session of their own, out of the group's reach."""
    def children(p):
        try:
            with open(f"/proc/{p}/task/{p}/children") as fh:
                return [int(c) for c in fh.read().split()]
        except OSError:
            return []

    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children(p)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for p in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


@contextlib.contextmanager
def tmpfs(mount: Path, size: str):
    """A tmpfs of ``size`` (mount's -o size=) at ``mount``, unmounted afterwards; the test is
    skipped where mounting is not allowed."""
    import pytest

    mount.mkdir(exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()[:200]})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
