"""Returns the glibc heap's free pages to the system before each micro-batch (CPU, opt-in).

On CPU, torch serves tensors of a few MB from the malloc heap. A forward and backward pass
frees hundreds of them in an order glibc cannot coalesce well, so the heap grows past what
is live and keeps the freed pages resident (benchmarks/README.md, "The free heap handed
back"). ``malloc_trim(0)`` hands the pages of every free chunk back (the chunks stay, so
nothing is moved or copied). Called before each micro-batch's forward, when the previous
backward has freed the activations, it lowers the peak RSS, but the next forward faults
those pages in again, which costs tokens/s (both measured in benchmarks/README.md): so it
is ``--trim_host_memory true``, off by default. ``RunConfig.trim_host_memory`` decides
whether a run does it (CPU only: on CUDA the activations are not on the host heap).
"""

from __future__ import annotations

import ctypes
import functools
import platform
from typing import Callable, Optional


@functools.lru_cache(maxsize=None)
def _malloc_trim() -> Optional[Callable[[int], int]]:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None  # musl, macOS: no malloc_trim (their allocators return memory themselves)
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def available() -> bool:
    """Whether this process's C library can return free heap pages (glibc on Linux)."""
    return _malloc_trim() is not None


def release_free_heap() -> bool:
    """Hands the heap's free pages back to the system; True if any were returned."""
    trim = _malloc_trim()
    return bool(trim is not None and trim(0))


def trimming(forward_step: Callable) -> Callable:
    """``forward_step`` releasing the free heap first: the previous micro-batch's
    activations were freed by its backward, and this forward would otherwise allocate around
    their still-resident pages."""

    @functools.wraps(forward_step)
    def forward_step_after_trim(*args, **kwargs):
        release_free_heap()
        return forward_step(*args, **kwargs)

    return forward_step_after_trim
