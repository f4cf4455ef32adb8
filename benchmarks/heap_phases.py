"""The glibc heap at each phase of a training step: live bytes, free-but-resident, RSS.

Runs throughput.py's contenders (the same model, rows and batch) once each, with a probe
installed before the contender starts (this script re-runs itself as the child's entry
point, then hands over to ``python -m swift_mcore`` or hf_peer.py). The probe reads the
process's RSS and glibc's ``mallinfo2`` when each backward pass starts (the end of a
micro-batch's forward), when it ends, and around each optimizer step: the heap in use (live
allocations), the heap's free chunks (freed, still resident unless trimmed) and the
mmapped bytes (large tensors, returned on free). Peak RSS far above "in use + mmapped" is
the fragmentation of the heap, not tensors anything holds.

  python benchmarks/heap_phases.py --size 100m --seq 1024
  python benchmarks/heap_phases.py --size 100m --seq 1024 --contenders swift-mcore swift-mcore-trim-heap hf-trainer
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import runpy
import sys
import tempfile

import bench_common  # noqa: F401  (puts the checkout on sys.path)

PROBE_LOG = "HEAP_PHASES_LOG"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def install_probe(path: str) -> None:
    """Wraps torch.autograd.backward and AdamW.step (both contenders go through them) so
    that each phase appends one JSON line to ``path``."""
    import torch

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    page = os.sysconf("SC_PAGE_SIZE")
    out = open(path, "a", encoding="utf-8")

    def mark(phase: str) -> None:
        with open("/proc/self/statm", encoding="ascii") as fh:
            rss = int(fh.read().split()[1]) * page
        info = libc.mallinfo2()
        out.write(json.dumps({
            "phase": phase, "rss_MB": rss >> 20,
            "peak_rss_MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10,
            "heap_in_use_MB": info.uordblks >> 20, "heap_free_MB": info.fordblks >> 20,
            "mmapped_MB": info.hblkhd >> 20}) + "\n")
        out.flush()

    backward = torch.autograd.backward

    def probed_backward(*args, **kwargs):
        mark("forward done")
        result = backward(*args, **kwargs)
        mark("backward done")
        return result

    torch.autograd.backward = probed_backward
    step = torch.optim.AdamW.step

    def probed_step(self, *args, **kwargs):
        result = step(self, *args, **kwargs)
        mark("optimizer step done")
        return result

    torch.optim.AdamW.step = probed_step


def child(argv) -> None:
    """The contender's process: the probe, then its real entry point."""
    install_probe(os.environ[PROBE_LOG])
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


def main():
    import throughput

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="100m", choices=sorted(throughput.SIZES))
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=1)
    parser.add_argument("--contenders", nargs="+", default=["swift-mcore", "hf-trainer"],
                        choices=("swift-mcore", "swift-mcore-trim-heap", "hf-trainer"))
    opts = parser.parse_args()
    opts.device, opts.num_workers, opts.hf_attention, opts.tiny = "cpu", 1, "sdpa", False
    measured = throughput.run_measured
    results = []
    with tempfile.TemporaryDirectory(prefix="heap_phases_") as workdir:
        case = throughput.prepare_case(opts.size, opts.seq, opts, workdir)
        for name in opts.contenders:
            log = os.path.join(workdir, f"{name}.jsonl")

            def probed(cmd, env, log=log):
                return measured([cmd[0], os.path.abspath(__file__), "--child", *cmd[1:]],
                                {**env, PROBE_LOG: log})

            throughput.run_measured = probed
            try:
                run = throughput.run_contender(name, case["flags"], case, opts, workdir)
            finally:
                throughput.run_measured = measured
            with open(log, encoding="utf-8") as fh:
                phases = [json.loads(line) for line in fh]
            results.append({"contender": name, "peak_rss_MB": round(run["rss_MB"]),
                            "tokens_per_s": round(run["tokens_per_s"], 1), "phases": phases})
    for r in results:
        print(f"{r['contender']}: peak RSS {r['peak_rss_MB']} MB, {r['tokens_per_s']} tokens/s",
              file=sys.stderr)
        print("  | phase | RSS | heap in use | heap free | mmapped |", file=sys.stderr)
        for p in r["phases"]:
            print(f"  | {p['phase']} | {p['rss_MB']} | {p['heap_in_use_MB']} | "
                  f"{p['heap_free_MB']} | {p['mmapped_MB']} |", file=sys.stderr)
    print(json.dumps({"size": opts.size, "seq_length": opts.seq, "runs": results}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
    else:
        main()
