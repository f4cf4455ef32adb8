"""--trim_host_memory: the glibc heap's free pages go back to the system before each forward."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from swift_mcore import RunArguments
from swift_mcore.run_config import resolve
from swift_mcore.runtime.cpu import host_memory

ROOT = Path(__file__).resolve().parents[1]
needs_glibc = pytest.mark.skipif(not host_memory.available(), reason="needs glibc's malloc_trim")

# Chunks of 4 MiB from the heap (glibc's mmap threshold raised above them, and no automatic
# trim of the heap's top), each followed by a small chunk that stays, so that freeing the big
# ones leaves holes glibc keeps resident: the pattern a forward and backward pass leaves.
HOLES = r"""
import ctypes, json, os
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * page / 2**20
from swift_mcore.runtime.cpu import host_memory
base = rss()
big, small = [], []
for _ in range(64):
    big.append(libc.malloc(4 << 20)); ctypes.memset(big[-1], 1, 4 << 20)
    small.append(libc.malloc(64))
for p in big:
    libc.free(p)
held = rss()
released = host_memory.release_free_heap()
print(json.dumps({"base": base, "held": held, "after": rss(), "released": released}))
"""


@needs_glibc
def test_release_hands_the_freed_heap_back():
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 << 20),
           "MALLOC_TRIM_THRESHOLD_": str(1 << 40), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", HOLES], env=env, capture_output=True,
                         text=True, check=True, timeout=60).stdout
    rss = json.loads(out)
    assert rss["held"] - rss["base"] > 200  # of the 256 MiB freed: glibc kept them
    assert rss["held"] - rss["after"] > 200 and rss["released"] is True


def test_the_decision_is_made_once_and_only_for_cpu_runs():
    default = resolve(RunArguments(), world_size=1, cuda=False)
    assert default.trim_host_memory is False and "free heap" not in default.describe()
    on = RunArguments.from_flags(trim_host_memory=True)
    cpu = resolve(on, world_size=1, cuda=False)
    assert cpu.trim_host_memory is host_memory.available()
    assert ("free heap released" in cpu.describe()) is host_memory.available()
    gpu = resolve(on, world_size=1, cuda=True, transformer_engine=False)
    assert gpu.trim_host_memory is False and "free heap" not in gpu.describe()


@needs_glibc
def test_training_releases_the_heap_before_every_micro_batch(gloo_group, tmp_path,
                                                             monkeypatch):
    from in_process import train_in_process

    calls = []
    real = host_memory.release_free_heap
    monkeypatch.setattr(host_memory, "release_free_heap", lambda: calls.append(1) or real())
    train_in_process(tmp_path / "run", "--train_iters", "2", "--no_save",
                     "--trim_host_memory", "true", command="pt")
    assert len(calls) == 2 * 4  # iterations x micro-batches (global 8 / micro 2, TINY)
