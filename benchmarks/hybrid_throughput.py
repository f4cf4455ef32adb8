"""Training tokens/s of a small hybrid model (Qwen3.5's dense text model: gated delta-net
layers among gated full-attention layers, Qwen3-Next's layer kinds) through `swift-mcore pt`,
against transformers' own training step on the same model and against a dense model of the
same size (Qwen3: every layer full attention, the same hidden size, heads and MLP).

Both models are random Hugging Face folders written here (nothing downloaded). Per round:
`pt --model FOLDER` for the hybrid and the dense folder, each in its own process, in an order
that alternates (tokens/s of the iterations after the first, from metrics.jsonl), and
transformers' step on the hybrid model in a child process: AdamW, fp32, the same micro-batch
of random token rows, forward + backward + step, the steps after the first timed. Reported:
the medians per run kind and the medians over rounds of hybrid / dense (swift-mcore) and
swift-mcore / transformers (the hybrid model), so drifting load hits both alike. Prints one
JSON line.

  python benchmarks/hybrid_throughput.py                     # 4 layers (3 delta-net), hidden 256
  python benchmarks/hybrid_throughput.py --tiny --rounds 1   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench_common import ROOT, on_path  # puts the checkout on sys.path


def text_shape(args) -> dict:
    return dict(hidden_size=args.hidden, intermediate_size=args.ffn,
                num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                head_dim=args.hidden // 4, vocab_size=320, max_position_embeddings=4096)


def hybrid_shape(args) -> dict:
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
             for i in range(args.layers)]
    return dict(text_shape(args), layer_types=kinds, linear_conv_kernel_dim=4,
                linear_key_head_dim=args.hidden // 8, linear_value_head_dim=args.hidden // 8,
                linear_num_key_heads=4, linear_num_value_heads=8,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.25})


def write_folder(path: str, model_type: str, shape: dict) -> int:
    """A random model of ``model_type`` with a tokenizer; returns its parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    on_path("tests")
    on_path("tests", "models")
    from hf_helpers import write_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **shape))
    model.save_pretrained(path)
    write_tokenizer(path)
    return sum(p.numel() for p in model.parameters())


def swift_mcore_run(folder: str, data: str, args, out: str) -> float:
    flags = ["--model", folder, "--dataset", data, "--seq_length", str(args.seq),
             "--micro_batch_size", "2", "--global_batch_size", "2",
             "--train_iters", str(args.iters + 1), "--log_interval", "1", "--eval_steps", "0",
             "--lr_warmup_iters", "0", "--progress_bar", "false", "--tensorboard", "false",
             "--plot", "false", "--no_save", "--num_workers", "0", "--precision", "fp32"]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "pt", *flags,
                           "--output_dir", out], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"pt --model {folder} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as fh:
        records = [r for r in map(json.loads, fh) if r.get("split") == "train"]
    timed = records[1:]  # the first iteration warms up
    return sum(r["tokens"] for r in timed) / sum(r["tokens"] / r["tokens_per_s"] for r in timed)


def transformers_run(folder: str, args) -> float:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run([sys.executable, __file__, "--transformers_child", folder,
                           "--seq", str(args.seq), "--iters", str(args.iters),
                           "--threads", str(args.threads)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"transformers' step on {folder} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["tokens_per_s"]


def transformers_child(folder: str, args) -> None:
    """transformers' training step on ``folder``'s model: 2 rows of seq tokens, AdamW."""
    import time

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    times = []
    for _ in range(args.iters + 1):
        rows = torch.randint(0, 300, (2, args.seq), generator=generator)
        start = time.perf_counter()
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    timed = times[1:]  # the first step warms up
    print(json.dumps({"tokens_per_s": 2 * args.seq * len(timed) / sum(timed)}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--transformers_child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.ffn, args.seq, args.iters = 4, 64, 96, 32, 2
    if args.transformers_child:
        transformers_child(args.transformers_child, args)
        return
    results = {"hybrid": [], "dense": [], "transformers": []}
    versus_dense, versus_transformers = [], []
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"hybrid": os.path.join(tmp, "hybrid"), "dense": os.path.join(tmp, "dense")}
        params = {"hybrid": write_folder(folders["hybrid"], "qwen3_5_text",
                                         hybrid_shape(args)),
                  "dense": write_folder(folders["dense"], "qwen3", text_shape(args))}
        data = os.path.join(tmp, "data.jsonl")
        with open(data, "w", encoding="utf-8") as fh:
            for i in range(400):
                fh.write(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n" * 4})
                         + "\n")
        for round_ in range(args.rounds):
            order = ("hybrid", "dense", "transformers") if round_ % 2 == 0 else \
                ("transformers", "dense", "hybrid")
            got = {}
            for kind in order:
                got[kind] = (transformers_run(folders["hybrid"], args) if kind == "transformers"
                             else swift_mcore_run(folders[kind], data, args,
                                                  os.path.join(tmp, f"{kind}{round_}")))
                results[kind].append(got[kind])
            versus_dense.append(got["hybrid"] / got["dense"])
            versus_transformers.append(got["hybrid"] / got["transformers"])
    print(json.dumps({
        "shape": {"layers": args.layers, "hidden": args.hidden, "ffn": args.ffn,
                  "seq": args.seq, "delta_net_layers": hybrid_shape(args)["layer_types"]
                  .count("linear_attention")},
        "parameters": params,
        "hybrid_tokens_per_s_median": statistics.median(results["hybrid"]),
        "dense_tokens_per_s_median": statistics.median(results["dense"]),
        "transformers_tokens_per_s_median": statistics.median(results["transformers"]),
        "hybrid_vs_dense_median": statistics.median(versus_dense),
        "hybrid_vs_transformers_median": statistics.median(versus_transformers),
        "rounds": args.rounds,
    }))


if __name__ == "__main__":
    main()
