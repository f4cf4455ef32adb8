"""Peak host memory of `swift-mcore export --to_mcore` and `--to_hf` against the size of the weights.

A random Hugging Face MoE folder (DeepSeek-V3 by default: multi-latent attention, a dense
first layer, routed and shared experts) is written shard by shard straight from the
parameter shapes of a model built on the meta device, so making it never holds the model in
memory either. Then, each in its own process (peak RSS: ru_maxrss from wait4):

* ``runtime``   the same conversion of a one-layer model of the same family: what importing
                torch, megatron-core and transformers and setting up a rank cost before any
                weight is read (the floor every conversion pays);
* ``to_mcore``  `export --to_mcore` of the folder (read lazily, slice by slice, into the
                megatron model; written as a sharded checkpoint);
* ``to_hf``     `export --to_hf` of that checkpoint back to safetensors shards.

Reported per direction: peak RSS / weight bytes (the issue's goal: <= 1.2x) and
(peak RSS - runtime) / weight bytes, the part that grows with the model.

  python benchmarks/conversion_memory.py                       # ~2 GB of bf16 weights
  python benchmarks/conversion_memory.py --gigabytes 6 --family qwen3_moe
  python benchmarks/conversion_memory.py --tiny                # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from bench_common import child_env  # puts the checkout on sys.path
from throughput import run_measured

SHARD_BYTES = 500 * 2**20  # what save_pretrained's default max_shard_size would give, about
# Per family: the config of one layer's worth of experts; --gigabytes picks the layer count.
FAMILIES = {
    "deepseek_v3": dict(
        hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
        n_routed_experts=32, n_shared_experts=1, num_experts_per_tok=4, n_group=4,
        topk_group=2, first_k_dense_replace=1, q_lora_rank=384, kv_lora_rank=256,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096),
    "qwen3_moe": dict(
        hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
        num_experts=32, num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=4,
        head_dim=128, vocab_size=32000, max_position_embeddings=4096),
}
TINY = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=32,
            kv_lora_rank=32, head_dim=16, num_attention_heads=4, num_key_value_heads=4,
            vocab_size=320, n_routed_experts=8, num_experts=8, n_group=4, topk_group=2)


def config_for(family: str, layers: int, tiny: bool):
    from transformers import AutoConfig

    values = {**FAMILIES[family], **({k: v for k, v in TINY.items()
                                      if k in FAMILIES[family]} if tiny else {})}
    return AutoConfig.for_model(family, num_hidden_layers=layers, **values)


def shapes(config, dtype):
    """(name, shape) of every tensor the folder of ``config`` holds, by the names
    save_pretrained writes (per-expert tensors, not transformers' fused in-memory ones): a
    three-layer model of the same widths is saved once, and its third layer stands for every
    later one."""
    import copy
    import re

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    small = copy.deepcopy(config)
    small.num_hidden_layers = 3
    with tempfile.TemporaryDirectory() as folder:
        AutoModelForCausalLM.from_config(small, dtype=dtype).save_pretrained(folder)
        saved = []
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(folder, name), "pt") as fh:
                    saved += [(key, tuple(fh.get_slice(key).get_shape())) for key in fh.keys()]
    layer = re.compile(r"\.layers\.(\d+)\.")
    out = []
    for key, shape in saved:
        match = layer.search(key)
        if match is None or int(match.group(1)) < 2:
            out.append((key, shape))
        else:
            out += [(layer.sub(f".layers.{i}.", key, count=1), shape)
                    for i in range(2, config.num_hidden_layers)]
    return out


def write_folder(path: str, config, dtype) -> int:
    """Random weights in shards of about SHARD_BYTES; returns the weight bytes."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(path)
    config.dtype = dtype
    config.save_pretrained(path)
    generator = torch.Generator().manual_seed(0)
    shard, shard_bytes, weight_map, total, files = {}, 0, {}, 0, []

    def flush():
        nonlocal shard, shard_bytes
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update({key: name for key in shard})
        shard, shard_bytes = {}, 0

    element = torch.empty((), dtype=dtype).element_size()
    for name, shape in shapes(config, dtype):
        tensor = (0.02 * torch.randn(shape, generator=generator)).to(dtype)
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            tensor = torch.ones(shape, dtype=dtype)
        nbytes = tensor.numel() * element
        if shard and shard_bytes + nbytes > SHARD_BYTES:
            flush()
        shard[name] = tensor
        shard_bytes += nbytes
        total += nbytes
    flush()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh)
    return total


def layers_for(family: str, gigabytes: float, dtype, tiny: bool) -> int:
    """The layer count whose folder is about ``gigabytes`` (at least 3)."""
    import torch

    element = torch.empty((), dtype=dtype).element_size()
    sizes = [sum(_numel(s) for _, s in shapes(config_for(family, n, tiny), dtype)) * element
             for n in (3, 4)]
    per_layer, fixed = sizes[1] - sizes[0], sizes[0] - 3 * (sizes[1] - sizes[0])
    return max(3, round((gigabytes * 2**30 - fixed) / per_layer))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def export(source: str, out: str, direction: str):
    cmd = [sys.executable, "-m", "swift_mcore", "export", "--model", source,
           "--output_dir", out, f"--{direction}"]
    return run_measured(cmd, child_env(PYTHONWARNINGS="ignore"))


def prepare(spec: dict) -> None:
    """In a child process (the parent's memory would otherwise be the measured exports' too:
    ru_maxrss keeps the high-water mark of the image a child was forked from): both folders,
    and their layer count and weight bytes as one JSON line."""
    import torch

    dtype = getattr(torch, spec["dtype"])
    family, tiny = spec["family"], spec["tiny"]
    layers = 3 if tiny else layers_for(family, spec["gigabytes"], dtype, False)
    write_folder(spec["small"], config_for(family, 3, True), dtype)
    weights = write_folder(spec["big"], config_for(family, layers, tiny), dtype)
    print(json.dumps({"layers": layers, "weights": weights}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="deepseek_v3")
    parser.add_argument("--gigabytes", type=float, default=2.0,
                        help="about how large the folder's weights are")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--tiny", action="store_true", help="a few-MB model (smoke test)")
    parser.add_argument("--prepare", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.prepare:
        return prepare(json.loads(opts.prepare))
    work = tempfile.mkdtemp(prefix="conversion_memory_")
    try:
        small, big = os.path.join(work, "small"), os.path.join(work, "hf")
        spec = {"family": opts.family, "gigabytes": opts.gigabytes, "dtype": opts.dtype,
                "tiny": opts.tiny, "small": small, "big": big}
        stdout = run_measured([sys.executable, __file__, "--prepare", json.dumps(spec)],
                              child_env())[0]
        made = json.loads(stdout.strip().splitlines()[-1])
        runtime = export(small, os.path.join(work, "small_mcore"), "to_mcore")[2]
        to_mcore = export(big, os.path.join(work, "mcore"), "to_mcore")
        to_hf = export(os.path.join(work, "mcore"), os.path.join(work, "back"), "to_hf")
        mb = made["weights"] / 2**20
        result = {"family": opts.family, "layers": made["layers"], "dtype": opts.dtype,
                  "weights_MB": round(mb, 1), "runtime_MB": round(runtime, 1)}
        for name, run in (("to_mcore", to_mcore), ("to_hf", to_hf)):
            peak = run[2]
            result[name] = {"peak_MB": round(peak, 1), "peak_over_weights": round(peak / mb, 3),
                            "growth_over_weights": round((peak - runtime) / mb, 3),
                            "wall_s": round(run[3], 1)}
        print(json.dumps(result), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
