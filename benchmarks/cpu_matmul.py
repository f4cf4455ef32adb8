"""What --cpu_matmul onednn gains over mkl: the linear layers' GEMMs one by one, then whole
micro-steps of one model with the two alternated.

Part 1 times, for each distinct weight shape of the model (qkv, proj, fc1, fc2, output
layer), the three products of a linear on the micro-batch's rows: the forward (x @ W.T)
and the input gradient (g @ W) on MKL (torch.mm, megatron's path) and on oneDNN
(torch.ops.mkldnn._linear_pointwise, runtime/cpu/onednn_linear.py), and the weight gradient
added into main_grad (MKL's addmm_, what both settings use) against oneDNN's product plus
a separate add (the form oneDNN offers, which this project does not use). Part 2 builds the
GPTModel as ``swift-mcore pt`` does (sdpa, fp32, megatron's DDP), and times one step's
micro-batches (forward and backward, no optimizer) with oneDNN on and off in turn, on the
same weights and tokens; then how far the two settings' gradients lie apart.

  python benchmarks/cpu_matmul.py                          # 10m, seq 512
  python benchmarks/cpu_matmul.py --size 100m --seq_length 1024 --rounds 3
  python benchmarks/cpu_matmul.py --tiny                   # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from bench_common import SIZES  # puts the checkout on sys.path
from wgrad_accumulation import build_ddp_model  # noqa: E402


def _median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_table(shapes, rows: int, repeats: int) -> list:
    """GFLOP/s of each product per weight shape (out, in), MKL against oneDNN."""
    import torch

    from swift_mcore.runtime.cpu.onednn_linear import _onednn

    table = []
    for out_features, in_features in shapes:
        x = torch.randn(rows, in_features)
        w = torch.randn(out_features, in_features)
        g = torch.randn(rows, out_features)
        main_grad = torch.zeros(out_features, in_features)
        gflop = 2 * rows * out_features * in_features / 1e9
        seconds = {
            "forward_mkl": _median_s(lambda: torch.mm(x, w.t()), repeats),
            "forward_onednn": _median_s(lambda: _onednn(x, w), repeats),
            "dgrad_mkl": _median_s(lambda: torch.mm(g, w), repeats),
            "dgrad_onednn": _median_s(lambda: _onednn(g, w.t()), repeats),
            "wgrad_mkl_addmm": _median_s(lambda: main_grad.addmm_(g.t(), x), repeats),
            "wgrad_onednn_add": _median_s(lambda: main_grad.add_(_onednn(g.t(), x.t())),
                                          repeats),
        }
        entry = {"weight": [out_features, in_features], "rows": rows}
        entry.update({f"{k}_GFLOPs": round(gflop / s, 1) for k, s in seconds.items()})
        for product, mkl, onednn in (("forward", "forward_mkl", "forward_onednn"),
                                     ("dgrad", "dgrad_mkl", "dgrad_onednn"),
                                     ("wgrad", "wgrad_mkl_addmm", "wgrad_onednn_add")):
            entry[f"{product}_onednn_over_mkl_time"] = round(seconds[onednn] / seconds[mkl], 3)
        table.append(entry)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="10m", choices=sorted(SIZES))
    parser.add_argument("--seq_length", type=int, default=512)
    parser.add_argument("--micro_batches", type=int, default=4, help="per timed step")
    parser.add_argument("--rounds", type=int, default=5, help="steps per setting, alternated")
    parser.add_argument("--gemm_repeats", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="tiny model, seq 32 (smoke test)")
    opts = parser.parse_args()
    if opts.tiny:
        opts.size, opts.seq_length, opts.rounds, opts.micro_batches = "tiny", 32, 2, 2
        opts.gemm_repeats = 2

    import torch

    from swift_mcore._quiet import quiet_third_party

    quiet_third_party()
    from swift_mcore.runtime import distributed
    from swift_mcore.runtime.cpu import onednn_linear

    if not onednn_linear.available():
        sys.exit("this torch build has no oneDNN linear: nothing to compare")
    vocab = 4096
    ddp = build_ddp_model(opts.size, opts.seq_length, vocab)
    seq = opts.seq_length
    shapes = sorted({tuple(m.weight.shape) for m in ddp.modules()
                     if hasattr(m, "gradient_accumulation_fusion") and m.weight is not None})
    gemms = gemm_table(shapes, 2 * seq, opts.gemm_repeats)

    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (2, seq), generator=generator)
               for _ in range(opts.micro_batches)]
    position_ids = torch.arange(seq).expand(2, -1)

    def step():
        ddp.zero_grad_buffer()
        for tokens in batches:
            ddp(tokens, position_ids, None, labels=tokens).float().sum().backward()

    times = {"onednn": [], "mkl": []}
    grads = {}
    for name in times:  # warm-up, each setting once; its gradients for the comparison
        onednn_linear.enable(name == "onednn")
        step()
        grads[name] = [p.main_grad.clone() for p in ddp.module.parameters()]
    for _ in range(opts.rounds):
        for name in times:
            onednn_linear.enable(name == "onednn")
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    worst = max(((a - b).norm() / b.norm().clamp_min(1e-30)).item()
                for a, b in zip(grads["onednn"], grads["mkl"]))
    ratios = [o / m for o, m in zip(times["onednn"], times["mkl"])]
    print(json.dumps({
        "size": opts.size, "seq_length": seq, "micro_batches": opts.micro_batches,
        "threads": torch.get_num_threads(), "gemms": gemms,
        "step_s": {name: [round(t, 3) for t in ts] for name, ts in times.items()},
        "median_step_s": {name: round(statistics.median(ts), 3) for name, ts in times.items()},
        "onednn_over_mkl_step_time_median": round(statistics.median(ratios), 3),
        "largest_relative_gradient_difference": float(f"{worst:.3g}"),
    }), flush=True)
    distributed.shutdown()


if __name__ == "__main__":
    main()
