"""Where a training process's peak RSS goes: live heap at its high-water mark, by source line.

Runs throughput.py's contenders (the same model, rows and batch) once each under memray,
which records every native allocation with its Python stack. For each run it prints the
process's peak RSS (ru_maxrss, what throughput.py reports), memray's heap high-water mark
(the bytes malloc had handed out and not yet freed at the worst moment) and the largest
live allocations at that moment, grouped by the first frame in swift-mcore, megatron,
transformers or torch.optim. Peak RSS above the heap high-water mark is memory glibc keeps
after free() (heap fragmentation), not tensors anything holds.

``--mmap_threshold BYTES`` runs swift-mcore again with glibc's MALLOC_MMAP_THRESHOLD_ set
(allocations of that size and up are mmapped and go back to the system on free), to show
how much of the RSS is that retention and what serving large tensors by mmap costs.

  pip install -r requirements/bench.txt          # memray
  python benchmarks/rss_breakdown.py --size 100m --seq 512
  python benchmarks/rss_breakdown.py --size 100m --seq 512 --mmap_threshold 1048576
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

import bench_common  # noqa: F401  (puts the checkout on sys.path)
import throughput  # noqa: E402  (the contenders, rows and flags are throughput.py's)

SOURCES = ("swift_mcore", "megatron", "transformers", "torch/optim", "benchmarks")


def breakdown(path: str, top: int):
    """Heap high-water mark and its largest live allocations by source line."""
    from memray import FileReader

    reader = FileReader(path)
    by_line = collections.Counter()
    for record in reader.get_high_watermark_allocation_records(merge_threads=True):
        where = "(native or import)"
        for function, filename, line in record.stack_trace(max_stacks=40):
            if any(s in filename for s in SOURCES):
                where = f"{filename.split('site-packages/')[-1]}:{line} {function}"
                break
        by_line[where] += record.size
    return (reader.metadata.peak_memory / 2**20,
            [(where, round(size / 2**20, 1)) for where, size in by_line.most_common(top)])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="100m", choices=sorted(throughput.SIZES))
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=1)
    parser.add_argument("--contenders", nargs="+", default=["swift-mcore", "hf-trainer"],
                        choices=("swift-mcore", "swift-mcore-local", "hf-trainer"))
    parser.add_argument("--mmap_threshold", type=int,
                        help="also run swift-mcore with MALLOC_MMAP_THRESHOLD_ at this size")
    parser.add_argument("--top", type=int, default=12)
    opts = parser.parse_args()
    try:
        import memray  # noqa: F401
    except ImportError:
        raise SystemExit("memray is not installed: pip install -r requirements/bench.txt")
    opts.device, opts.num_workers, opts.hf_attention, opts.tiny = "cpu", 1, "sdpa", False

    measured = throughput.run_measured
    runs = [(name, None) for name in opts.contenders]
    if opts.mmap_threshold:
        runs.append(("swift-mcore", opts.mmap_threshold))
    results = []
    with tempfile.TemporaryDirectory(prefix="rss_breakdown_") as workdir:
        case = throughput.prepare_case(opts.size, opts.seq, opts, workdir)
        for name, threshold in runs:
            trace = os.path.join(workdir, f"{name}_{threshold}.bin")

            def under_memray(cmd, env, trace=trace, threshold=threshold):
                if threshold:
                    env = {**env, "MALLOC_MMAP_THRESHOLD_": str(threshold)}
                return measured([cmd[0], "-m", "memray", "run", "-q", "-o", trace, *cmd[1:]],
                                env)

            throughput.run_measured = under_memray
            try:
                run = throughput.run_contender(name, case["flags"], case, opts, workdir)
            finally:
                throughput.run_measured = measured
            heap_mb, top = breakdown(trace, opts.top)
            results.append({"contender": name, "mmap_threshold": threshold,
                            "peak_rss_MB": round(run["rss_MB"]), "heap_peak_MB": round(heap_mb),
                            "tokens_per_s": round(run["tokens_per_s"], 1), "top": top})
    for r in results:
        label = r["contender"] + (f" (mmap >= {r['mmap_threshold']} B)" if r["mmap_threshold"]
                                  else "")
        print(f"{label}: peak RSS {r['peak_rss_MB']} MB, heap high-water {r['heap_peak_MB']} MB, "
              f"{r['tokens_per_s']} tokens/s (under memray)", file=sys.stderr)
        for where, mb in r["top"]:
            print(f"  {mb:9.1f} MB  {where}", file=sys.stderr)
    print(json.dumps({"size": opts.size, "seq_length": opts.seq, "runs": results}), flush=True)


if __name__ == "__main__":
    main()
