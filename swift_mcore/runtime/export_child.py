"""`swift-mcore export --to_hf` in a child process of its own (--save_safetensors at a save):
on the CPU, with a one-rank process group, bounded in time."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional

# torchrun's variables: a child command must build its own one-rank process group.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
                "MASTER_PORT", "NPROC_PER_NODE", "NNODES", "NODE_RANK")


def export_in_subprocess(checkpoint: str, out_dir: str, timeout: Optional[float] = None,
                         dtype: Optional[str] = None,
                         group_timeout: Optional[float] = None) -> str:
    """`swift-mcore export --to_hf` in a fresh process (its own one-rank process group, so a
    training run of any layout can call it); returns its last output line.

    The child runs on the CPU (CUDA_VISIBLE_DEVICES empty): on a GPU it would take device 0,
    next to rank 0's training memory. It is bounded by ``timeout`` (default: 5 minutes, or a
    fifth where that is less, less than the process group's timeout, which the other ranks
    wait in meanwhile); past it the
    child is killed and the error names the command that converts the saved checkpoint by
    hand. ``dtype``: the weights' dtype in the folder (--dtype), e.g. the training precision.
    ``group_timeout``: the process group's timeout in seconds (--distributed_timeout_minutes;
    default runtime.distributed.TIMEOUT)."""
    from .distributed import TIMEOUT

    if timeout is None:
        group = TIMEOUT.total_seconds() if group_timeout is None else group_timeout
        timeout = max(group - 300, 0.8 * group)
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCH_VARS and not k.startswith("TORCHELASTIC_")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "swift_mcore", "export", "--to_hf", "--model", checkpoint,
           "--output_dir", out_dir, *(["--dtype", dtype] if dtype else [])]
    by_hand = "swift-mcore " + " ".join(cmd[3:])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`{by_hand}` did not finish within {timeout / 60:.0f} minutes and "
                           f"was stopped; the checkpoint {checkpoint} is saved: run that "
                           f"command to convert it") from None
    if proc.returncode != 0:
        raise RuntimeError(f"`{by_hand}` failed ({proc.returncode}): "
                           f"{proc.stderr.strip()[-2000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return lines[-1] if lines else f"wrote {out_dir}"
