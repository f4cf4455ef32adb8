"""What adding the weight gradients straight into DDP's main_grad saves on CPU: one model,
megatron's unfused path against the fused one, alternated micro-step by micro-step.

The CPU port turns on megatron's ``gradient_accumulation_fusion`` for the linears of a
DDP-wrapped chunk without CUDA (runtime/cpu/cpu_compat.py stands in for apex's kernel with one
``main_grad.addmm_``). Unfused, every linear allocates a weight-sized gradient per
micro-batch, which DDP's hook adds into ``main_grad`` and frees. This script builds the
GPTModel as ``swift-mcore pt`` does (sdpa attention, fp32), wraps it in megatron's DDP and
times one step's micro-batches (forward and backward, no optimizer) with the linears' flag
on and off in turn, on the same weights and tokens; then the allocator's peak over one
micro-step of each (activation_memory.allocator_peak).

  python benchmarks/wgrad_accumulation.py                          # 10m, seq 512
  python benchmarks/wgrad_accumulation.py --size 100m --seq_length 1024
  python benchmarks/wgrad_accumulation.py --tiny                   # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench_common import LLAMA, SIZES  # puts the checkout on sys.path

from activation_memory import allocator_peak  # noqa: E402


def build_ddp_model(size: str, seq_length: int, vocab: int):
    """The GPTModel as `swift-mcore pt` builds it for ``size`` (sdpa, fp32, micro-batch 2),
    in megatron's DDP, on a one-rank group; seeded, so every call has the same weights."""
    from swift_mcore.arguments import parse_args
    from swift_mcore.models.gpt import build_model
    from swift_mcore.run_config import resolve
    from swift_mcore.runtime import distributed, seed
    from swift_mcore.runtime.ddp import wrap_model

    args = resolve(parse_args([*SIZES[size], *LLAMA, "--seq_length", str(seq_length),
                               "--micro_batch_size", "2", "--global_batch_size", "2"]))
    args = args.complete(vocab, None, padded_vocab_size=vocab)
    distributed.initialize(args)
    seed.set_seed(0)
    (ddp,) = wrap_model(args, build_model(args))
    return ddp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="10m", choices=sorted(SIZES))
    parser.add_argument("--seq_length", type=int, default=512)
    parser.add_argument("--micro_batches", type=int, default=4, help="per timed step")
    parser.add_argument("--rounds", type=int, default=5, help="steps per setting, alternated")
    parser.add_argument("--tiny", action="store_true", help="tiny model, seq 32 (smoke test)")
    opts = parser.parse_args()
    if opts.tiny:
        opts.size, opts.seq_length, opts.rounds, opts.micro_batches = "tiny", 32, 2, 2

    import torch

    from swift_mcore._quiet import quiet_third_party

    quiet_third_party()
    from swift_mcore.runtime import distributed
    from swift_mcore.runtime.cpu.cpu_compat import accumulate_weight_gradients_in_place

    vocab = 4096
    ddp = build_ddp_model(opts.size, opts.seq_length, vocab)
    linears = [m for m in ddp.modules() if hasattr(m, "gradient_accumulation_fusion")]
    fused_count = accumulate_weight_gradients_in_place(ddp)
    seq = opts.seq_length
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (2, seq), generator=generator)
               for _ in range(opts.micro_batches)]
    position_ids = torch.arange(seq).expand(2, -1)

    def set_fused(on: bool):
        for linear in linears:
            linear.gradient_accumulation_fusion = on

    def micro_step(tokens):
        ddp(tokens, position_ids, None, labels=tokens).float().sum().backward()

    def step():
        ddp.zero_grad_buffer()
        for tokens in batches:
            micro_step(tokens)

    times = {"fused": [], "unfused": []}
    for name in times:  # warm-up, each path once
        set_fused(name == "fused")
        step()
    for _ in range(opts.rounds):
        for name in times:
            set_fused(name == "fused")
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    memory = {}
    for name in times:
        set_fused(name == "fused")
        ddp.zero_grad_buffer()
        micro_step(batches[0])
        peak, _ = allocator_peak(lambda: micro_step(batches[1]))
        memory[name] = {"peak_MB": round(peak / 2 ** 20, 1)}
    ratios = [f / u for f, u in zip(times["fused"], times["unfused"])]
    print(json.dumps({
        "size": opts.size, "seq_length": seq, "micro_batches": opts.micro_batches,
        "parameters": sum(p.numel() for p in ddp.module.parameters()),
        "fused_linears": fused_count,
        "step_s": {name: [round(t, 3) for t in ts] for name, ts in times.items()},
        "median_step_s": {name: round(statistics.median(ts), 3) for name, ts in times.items()},
        "fused_over_unfused_time_median": round(statistics.median(ratios), 3),
        "micro_step_memory": memory,
    }), flush=True)
    distributed.shutdown()


if __name__ == "__main__":
    main()
