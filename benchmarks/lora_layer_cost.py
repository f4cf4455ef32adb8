"""What the linear layers of one decoder layer cost forward and backward: full finetuning against a frozen base with and without its LoRA adapter.

The four linears of a Llama layer (linear_qkv, linear_proj, linear_fc1, linear_fc2) of the
100m shape (hidden 1,024, 16 heads, 4 query groups, FFN 2,752), megatron's own layers on
the CPU port's GEMM (--cpu_matmul), on 2,048 tokens (sft_vs_trl.py's 4 packed rows of 512):

- full: the weight trains; its gradient is added into ``main_grad`` (as after DDP);
- frozen: the weight frozen, no adapter (what LoRA's base costs: no weight gradient);
- lora_P: the frozen base with swift-mcore's LoRA layer, rank 8, alpha 32, dropout P.

Each variant runs forward + backward of every linear --reps times, the variants
alternating; the figure is the median CPU time of the calling thread with one torch
thread (the work of the step, which a loaded machine stretches in wall time but changes
little). Prints one line per linear and a JSON line with the layer's totals.

    .venv/bin/python benchmarks/lora_layer_cost.py
    .venv/bin/python benchmarks/lora_layer_cost.py --variants full,lora_0.05 --matmul mkl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from bench_common import ROOT  # noqa: F401  (puts the checkout first on sys.path)

import torch

SHAPES = {"linear_qkv": (False, 1024, 1536), "linear_proj": (True, 1024, 1024),
          "linear_fc1": (False, 1024, 5504), "linear_fc2": (True, 2752, 1024)}


def setup(matmul: str) -> None:
    import torch.distributed as dist

    from swift_mcore.runtime.cpu import before_import

    before_import(False)
    from megatron.core import parallel_state

    from swift_mcore.runtime.cpu import cpu_compat, onednn_linear

    cpu_compat.activate()
    onednn_linear.enable(onednn_linear.choose(matmul) == "onednn")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)


def make(name: str, variant: str):
    from megatron.core import tensor_parallel
    from megatron.core.transformer import TransformerConfig
    from peft import LoraConfig

    from swift_mcore.models.lora_layer import LoraParallelLinear

    row, fan_in, fan_out = SHAPES[name]
    config = TransformerConfig(num_layers=1, hidden_size=1024, num_attention_heads=16,
                               use_cpu_initialization=True)
    init = torch.nn.init.normal_
    if row:
        base = tensor_parallel.RowParallelLinear(fan_in, fan_out, config=config,
                                                 init_method=init, bias=False,
                                                 input_is_parallel=True, skip_bias_add=True)
    else:
        base = tensor_parallel.ColumnParallelLinear(fan_in, fan_out, config=config,
                                                    init_method=init, bias=False,
                                                    gather_output=False, skip_bias_add=True)
    if variant == "full":
        base.gradient_accumulation_fusion = True
        base.weight.main_grad = torch.zeros_like(base.weight)
        return base
    base.weight.requires_grad_(False)
    if variant == "frozen":
        return base
    layer = LoraParallelLinear(base, "default",
                               LoraConfig(lora_dropout=float(variant.split("_", 1)[1])),
                               r=8, lora_alpha=32)
    for module in layer.modules():  # the factors' gradients into main_grad, as after DDP
        if module is not base and isinstance(module, (tensor_parallel.ColumnParallelLinear,
                                                      tensor_parallel.RowParallelLinear)):
            module.gradient_accumulation_fusion = True
            module.weight.main_grad = torch.zeros_like(module.weight)
    return layer.train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="full,frozen,lora_0.05,lora_0.0")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--matmul", default="auto", choices=("auto", "onednn", "mkl"))
    args = parser.parse_args()
    variants = args.variants.split(",")
    for v in variants:
        if v not in ("full", "frozen") and not v.startswith("lora_"):
            parser.error(f"--variants: unknown {v!r}; full, frozen or lora_P (P the dropout)")
    torch.set_num_threads(1)
    setup(args.matmul)
    totals = {v: 0.0 for v in variants}
    for name, (_, fan_in, fan_out) in SHAPES.items():
        modules = {v: make(name, v) for v in variants}
        x = torch.randn(args.tokens // 4, 4, fan_in)
        grad = torch.randn(args.tokens // 4, 4, fan_out)
        spent = {v: [] for v in variants}
        for rep in range(args.reps + 1):  # the first round warms up
            for v in variants:
                inp = x.clone().requires_grad_()
                start = time.thread_time()
                modules[v](inp)[0].backward(grad)
                if rep:
                    spent[v].append(time.thread_time() - start)
        ms = {v: round(statistics.median(spent[v]) * 1e3, 1) for v in variants}
        for v in variants:
            totals[v] += ms[v]
        print(name, json.dumps(ms), flush=True)
    print(json.dumps({"layer_ms": {v: round(t, 1) for v, t in totals.items()},
                      "load": round(os.getloadavg()[0], 1)}), flush=True)


if __name__ == "__main__":
    main()
