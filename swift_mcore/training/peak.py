"""The peaks a run is measured against: one rank's device TFLOP/s (MFU's denominator) and the
process's peak memory.

The TFLOP/s peak is, in this order: --peak_tflops; on a GPU the data sheet's dense bf16
peak of a known model (matched on torch.cuda.get_device_name), else bf16 matmuls measured
on it; on CPU float32 matmuls measured on it with torch's threads. A measurement takes a
fraction of a second and is kept in the cache folder per (device, threads, torch version),
so later runs on the machine reuse it.
"""

from __future__ import annotations

import json
import os
import re
import resource
import sys
import time
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

# Dense (no sparsity) bf16 tensor-core TFLOP/s from NVIDIA's data sheets; the first pattern
# that matches the device name wins, so the more specific names come first.
GPU_BF16_PEAK_TFLOPS: Tuple[Tuple[str, str, float], ...] = (
    (r"\bH200\b", "H200", 989.4),
    (r"\bH100\b.*\bPCIe\b", "H100 PCIe", 756.0),
    (r"\bH100\b.*\bNVL\b", "H100 NVL", 835.0),
    (r"\bH100\b", "H100 SXM", 989.4),
    (r"\bH800\b.*\bPCIe\b", "H800 PCIe", 756.0),
    (r"\bH800\b", "H800 SXM", 989.4),
    (r"\bH20\b", "H20", 148.0),
    (r"\bGB200\b", "GB200", 2500.0),
    (r"\bB200\b", "B200", 2250.0),
    (r"\bA100\b", "A100", 312.0),
    (r"\bA800\b", "A800", 312.0),
    (r"\bL40S\b", "L40S", 362.1),
    (r"\bL40\b", "L40", 181.0),
    (r"\bL20\b", "L20", 119.5),
    (r"\bL4\b", "L4", 121.0),
    (r"\bA10\b", "A10", 125.0),
    (r"\bRTX A6000\b", "RTX A6000", 154.8),
    (r"\bRTX 4090\b", "RTX 4090", 165.2),
)


@dataclass(frozen=True)
class Peak:
    tflops: float
    source: str  # for the start-up line: where the number comes from

    def describe(self) -> str:
        return f"{self.tflops:.4g} TFLOP/s ({self.source})"


def data_sheet_peak(device_name: str) -> Optional[Tuple[str, float]]:
    """(model, dense bf16 TFLOP/s) of a known GPU, else None."""
    for pattern, model, tflops in GPU_BF16_PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return model, tflops
    return None


def device_peak(override: Optional[float], cuda: bool, measure=None) -> Peak:
    """The peak MFU is reported against (``measure``: stands in for the measurement)."""
    if override:
        return Peak(float(override), "--peak_tflops")
    measure = measure or cached_matmul_peak
    if cuda:
        name = torch.cuda.get_device_name()
        known = data_sheet_peak(name)
        if known:
            return Peak(known[1], f"{known[0]} dense bf16, data sheet")
        return Peak(measure("cuda"), f"bf16 matmul measured on {name}; --peak_tflops to set")
    return Peak(measure("cpu"), f"float32 matmul measured on this CPU with "
                                f"{torch.get_num_threads()} threads; --peak_tflops to set")


def measure_matmul_tflops(device: str, sizes=(512, 1024), repeats: int = 3) -> float:
    """Best TFLOP/s of torch.mm on square matrices: float32 on CPU, bf16 on a GPU."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cuda":
        sizes = (4096, 8192)
    best = 0.0
    # A generator of its own: drawing from the global one after seeding would change the
    # run's dropout masks whenever the peak is measured rather than read from the cache.
    generator = torch.Generator(device=device).manual_seed(0)
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
        out = torch.mm(a, b)  # the first call starts the thread pool / picks the kernel
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            if device == "cuda":
                torch.cuda.synchronize()
            best = max(best, 2 * n ** 3 / (time.perf_counter() - start))
    return best / 1e12


def _device_key(device: str) -> str:
    if device == "cuda":
        name = torch.cuda.get_device_name()
    else:
        name = _cpu_model()
        name += f" threads={torch.get_num_threads()}"
    return f"{device}: {name} torch={torch.__version__}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cached_matmul_peak(device: str) -> float:
    """The measured matmul peak of this device, from the cache when measured before."""
    from ..atomic_write import write_atomic
    from ..cache import cache_dir

    path = os.path.join(cache_dir("peak"), "matmul_tflops.json")
    key = _device_key(device)
    try:
        with open(path, encoding="utf-8") as fh:
            known = json.load(fh)
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    value = known.get(key)
    if isinstance(value, (int, float)) and value > 0:
        return float(value)
    value = measure_matmul_tflops(device)
    known[key] = value
    try:
        write_atomic(path, json.dumps(known, indent=1, sort_keys=True))
    except OSError:  # a read-only cache: measured again next time
        pass
    return value


def peak_memory_gb(cuda: bool) -> float:
    """This process's peak memory: the GPU memory torch allocated, or the resident set size
    of the process on CPU (ru_maxrss: KiB on Linux, bytes on macOS)."""
    if cuda:
        return torch.cuda.max_memory_allocated() / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1e9 if sys.platform == "darwin" else rss * 1024 / 1e9
