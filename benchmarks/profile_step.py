"""Where a training micro-step's time goes: megatron's model (local or sdpa attention)
against the equivalent HF LlamaForCausalLM, under torch.profiler.

Each contender (in its own process) builds its model from the same swift-mcore flags,
runs --warmup forward + backward passes on one micro-batch of random tokens, then
profiles --steps more and reports the self CPU time per step, split by kind of operator:

* ``matmul``: mm, addmm, bmm, baddbmm, matmul, linear (the 6N FLOPs and the score matmuls);
* ``attention_other``: softmax, masked_fill, the SDPA/flash kernels and their backward;
* ``elementwise_other``: everything else (RoPE, norms, SwiGLU, copies, the loss).

Plus the top operators by self CPU time. The optimizer is not part of it
(benchmarks/optimizer_step.py times megatron's). Prints one JSON line per contender.

  python benchmarks/profile_step.py --seq_length 1024 [swift-mcore model flags]
  python benchmarks/profile_step.py --tiny --steps 1          # smoke test
"""

import argparse
import json
import time

# bench_common puts the checkout on sys.path
from bench_common import LLAMA, SIZES, child_env, print_child_result

CONTENDERS = ("megatron-local", "megatron-sdpa", "hf-sdpa", "hf-eager")
MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
          "aten::linear"}
ATTENTION = ("softmax", "masked_fill", "scaled_dot_product", "flash_attention",
             "_efficient_attention")
# The 10M model of throughput.py, Llama-shaped, seq 1024, micro-batch 2.
DEFAULT = [*SIZES["10m"], "--micro_batch_size", "2", "--global_batch_size", "2",
           "--seq_length", "1024"]
TINY = [*SIZES["tiny"], "--micro_batch_size", "2", "--global_batch_size", "2",
        "--seq_length", "32"]


def kind(name: str) -> str:
    if name in MATMUL:
        return "matmul"
    if any(key in name for key in ATTENTION):
        return "attention_other"
    return "elementwise_other"


def child(contender, flags, warmup, steps):
    import torch

    from swift_mcore._quiet import quiet_third_party

    quiet_third_party()
    from swift_mcore.arguments import parse_args
    from swift_mcore.run_config import resolve

    vocab = 4096
    if contender.startswith("megatron"):
        backend = ["--attention_backend", contender.split("-")[1]]  # local | sdpa
        args = resolve(parse_args([*flags, *backend])).complete(vocab, None,
                                                                 padded_vocab_size=vocab)
        from swift_mcore.models.gpt import build_model
        from swift_mcore.runtime import distributed, seed

        distributed.initialize(args)
        seed.set_seed(0)
        model = build_model(args)[0]
        seq, mbs = args.model.seq_length, args.training.micro_batch_size
        position_ids = torch.arange(seq).expand(mbs, -1)

        def micro_step(tokens):
            model(tokens, position_ids, None, labels=tokens).float().mean().backward()
    else:
        args = resolve(parse_args(flags))
        from hf_peer import build_model as hf_model

        model = hf_model(args, vocab, contender.split("-")[1])
        model.train()
        seq, mbs = args.model.seq_length, args.training.micro_batch_size

        def micro_step(tokens):
            model(input_ids=tokens, labels=tokens).loss.backward()

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (mbs, seq), generator=generator)
    for _ in range(warmup):
        micro_step(tokens)
    model.zero_grad(set_to_none=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            micro_step(tokens)
        wall = (time.perf_counter() - start) / steps
    totals, ops = {}, []
    for event in prof.key_averages():
        self_s = event.self_cpu_time_total / 1e6 / steps
        totals[kind(event.key)] = totals.get(kind(event.key), 0.0) + self_s
        ops.append((self_s, event.key, event.count // steps))
    ops.sort(reverse=True)
    profiled = sum(totals.values())
    print(json.dumps({
        "contender": contender, "seq_length": seq, "micro_batch_size": mbs,
        "torch_threads": torch.get_num_threads(),
        "micro_step_s": round(wall, 4), "profiled_self_cpu_s": round(profiled, 4),
        "by_kind_s": {k: round(v, 4) for k, v in sorted(totals.items())},
        "top_ops": [{"op": name, "self_s": round(s, 4), "calls": calls,
                     "share": round(s / profiled, 3)} for s, name, calls in ops[:12]],
    }), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS),
                        choices=CONTENDERS)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    opts, rest = parser.parse_known_args()
    flags = [*(TINY if opts.tiny else DEFAULT), *LLAMA, *rest]
    if opts.child:
        return child(opts.child, flags, opts.warmup, opts.steps)
    env = child_env(PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    for contender in opts.contenders:
        print_child_result(contender, [__file__, "--child", contender, "--warmup", str(opts.warmup),
                                       "--steps", str(opts.steps),
                                       *(["--tiny"] if opts.tiny else []), *rest], env)


if __name__ == "__main__":
    main()
