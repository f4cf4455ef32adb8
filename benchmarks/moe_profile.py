"""Where a mixture-of-experts micro-step's time goes on CPU, against the dense model with the
same active parameters: the MoE layer's phases (router, permute, experts, unpermute) timed
in the forward pass, the backward pass's top autograd functions, and the expert GEMMs alone.

The shapes are moe_throughput.py's (4 layers, hidden 256, seq 256, micro-batch 2; 8 experts
of 256, top-2, alltoall dispatcher, aux loss 0.01; dense: MLP 512). Each model is built in
its own process like profile_step.py's, warmed up, then --steps forward + backward passes
are timed; the MoE layer's methods are wrapped with timers (megatron's own methods, called
as they are). Ratios are taken within one process run, so the machine's load hits both
alike. Prints one JSON line per model, one for the GEMMs, and one for the MoE step with
the experts' SwiGLU against megatron's glu (both in one process, steps alternating).

  python benchmarks/moe_profile.py                 # the moe_throughput.py shape
  python benchmarks/moe_profile.py --tiny --steps 1
  python benchmarks/moe_profile.py --only glu --layers 2 --hidden 128 --expert_ffn 128 --seq 128
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time

from bench_common import ROOT, child_env, print_child_result  # puts the checkout on sys.path
from moe_throughput import add_shape_arguments  # noqa: E402

# MoE layer phase -> megatron methods whose time it is (moe_layer.py:357, token_dispatcher.py)
PHASES = {
    "router": [("layer", "route")],
    "permute": [("dispatcher", "dispatch_preprocess"), ("dispatcher", "token_dispatch"),
                ("dispatcher", "dispatch_postprocess")],
    "experts": [("experts", "forward")],
    "unpermute": [("dispatcher", "combine_preprocess"), ("dispatcher", "token_combine"),
                  ("dispatcher", "combine_postprocess")],
}


def flags(opts, kind):
    shape = ["--num_layers", str(opts.layers), "--hidden_size", str(opts.hidden),
             "--num_attention_heads", "4", "--num_query_groups", "2",
             "--seq_length", str(opts.seq), "--micro_batch_size", "2",
             "--global_batch_size", "2", "--attention_backend", "sdpa"]
    if kind == "moe":
        return shape + ["--num_experts", str(opts.experts), "--moe_router_topk",
                        str(opts.topk), "--moe_ffn_hidden_size", str(opts.expert_ffn),
                        "--ffn_hidden_size", str(opts.expert_ffn), "--moe_aux_loss_coeff",
                        "0.01"]
    return shape + ["--ffn_hidden_size", str(opts.topk * opts.expert_ffn)]


def timed(method, name, totals):
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start
    return call


def child(opts, kind):
    import torch
    from torch.profiler import ProfilerActivity, profile

    from swift_mcore._quiet import quiet_third_party

    quiet_third_party()
    from swift_mcore.arguments import parse_args
    from swift_mcore.models.gpt import build_model
    from swift_mcore.run_config import resolve
    from swift_mcore.runtime import distributed, seed

    vocab = 4096
    config = resolve(parse_args(flags(opts, kind))).complete(vocab, None,
                                                             padded_vocab_size=vocab)
    distributed.initialize(config)
    seed.set_seed(0)
    model = build_model(config)[0]
    model.train()
    totals = collections.defaultdict(float)
    for layer in model.decoder.layers:
        mlp = layer.mlp
        if type(mlp).__name__ != "MoELayer":
            continue
        owners = {"layer": mlp, "dispatcher": mlp.token_dispatcher, "experts": mlp.experts}
        for phase, methods in PHASES.items():
            for owner, name in methods:
                obj = owners[owner]
                setattr(obj, name, timed(getattr(obj, name), phase, totals))
    seq, mbs = config.model.seq_length, config.training.micro_batch_size
    tokens = torch.randint(0, vocab, (mbs, seq), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(seq).expand(mbs, -1)

    def forward():
        return model(tokens, position_ids, None, labels=tokens).float().mean()

    for _ in range(opts.warmup):
        forward().backward()
    totals.clear()
    fwd = bwd = 0.0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(opts.steps):
            start = time.perf_counter()
            loss = forward()
            middle = time.perf_counter()
            loss.backward()
            fwd += middle - start
            bwd += time.perf_counter() - middle
    backward = collections.defaultdict(float)
    for event in prof.key_averages():
        if event.key.startswith("autograd::engine::evaluate_function: "):
            name = event.key.split(": ", 1)[1]
            backward[name] += event.cpu_time_total / 1e6 / opts.steps
    steps = opts.steps
    out = {"model": kind, "forward_s": round(fwd / steps, 4),
           "backward_s": round(bwd / steps, 4),
           "moe_forward_phases_s": {k: round(v / steps, 4) for k, v in totals.items()},
           "backward_top_s": {k: round(v, 4) for k, v in
                              sorted(backward.items(), key=lambda kv: -kv[1])[:10]}}
    print(json.dumps(out), flush=True)


def glu_ab(opts):
    """The MoE micro-step with the experts' SwiGLU (models/swiglu.py) against megatron's own
    glu, both models in this process and their steps alternating, so load hits both alike."""
    import statistics

    import torch

    from swift_mcore._quiet import quiet_third_party

    quiet_third_party()
    from swift_mcore.arguments import parse_args
    from swift_mcore.models import gpt
    from swift_mcore.run_config import resolve
    from swift_mcore.runtime import distributed, seed

    vocab = 4096
    config = resolve(parse_args(flags(opts, "moe"))).complete(vocab, None,
                                                              padded_vocab_size=vocab)
    distributed.initialize(config)
    models = {}
    for name, use in (("swiglu", True), ("megatron_glu", False)):
        original = gpt.swiglu_module
        gpt.swiglu_module = (lambda c: use and original(c))
        try:
            seed.set_seed(0)
            models[name] = gpt.build_model(config)[0]
        finally:
            gpt.swiglu_module = original
    seq, mbs = config.model.seq_length, config.training.micro_batch_size
    tokens = torch.randint(0, vocab, (mbs, seq), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(seq).expand(mbs, -1)
    times = {name: [] for name in models}
    for i in range(opts.warmup + opts.steps):
        for name, model in models.items():
            start = time.perf_counter()
            model(tokens, position_ids, None, labels=tokens).float().mean().backward()
            if i >= opts.warmup:
                times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(json.dumps({"glu": "MoE micro-step, the experts' activation", "median_s":
                      {k: round(v, 4) for k, v in median.items()},
                      "swiglu_vs_megatron_glu_time": round(median["swiglu"]
                                                           / median["megatron_glu"], 3),
                      "steps": opts.steps}), flush=True)


def gemms(opts):
    """The routed tokens' expert GEMMs (forward, fc1) as SequentialMLP runs them, one per
    expert of tokens x topk / experts rows, against the dense MLP's one GEMM."""
    import torch

    tokens = 2 * opts.seq
    rows = tokens * opts.topk // opts.experts
    x = torch.randn(tokens, opts.hidden)
    pieces = list(x.repeat(opts.topk, 1).split(rows))
    w_expert = [torch.randn(opts.hidden, 2 * opts.expert_ffn) for _ in range(opts.experts)]
    w_dense = torch.randn(opts.hidden, 2 * opts.topk * opts.expert_ffn)

    def best(fn, repeat=20):
        fn()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    experts = best(lambda: [p @ w for p, w in zip(pieces, w_expert)])
    dense = best(lambda: x @ w_dense)
    print(json.dumps({"gemm": f"fc1 forward, {opts.experts} x [{rows}, {opts.hidden}] x "
                      f"[{opts.hidden}, {2 * opts.expert_ffn}] vs [{tokens}, {opts.hidden}] x "
                      f"[{opts.hidden}, {2 * opts.topk * opts.expert_ffn}]",
                      "experts_s": round(experts, 6), "dense_s": round(dense, 6),
                      "experts_vs_dense_time": round(experts / dense, 2)}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(parser)  # the same shapes as moe_throughput.py's
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", nargs="+", default=["moe", "dense", "gemm", "glu"],
                        choices=["moe", "dense", "gemm", "glu"])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.tiny:
        opts.layers, opts.hidden, opts.expert_ffn, opts.seq = 2, 64, 32, 32
    if opts.child:
        import torch

        torch.set_num_threads(opts.threads)
        if opts.child in ("gemm", "glu"):
            return gemms(opts) if opts.child == "gemm" else glu_ab(opts)
        return child(opts, opts.child)
    env = child_env(PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT,
                    OMP_NUM_THREADS=str(opts.threads))
    passed = [a for a in sys.argv[1:]]
    for kind in opts.only:
        print_child_result(kind, [__file__, "--child", kind, *passed], env)


if __name__ == "__main__":
    main()
