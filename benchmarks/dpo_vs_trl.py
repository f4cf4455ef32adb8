"""DPO against TRL 1.16's DPOTrainer on the same model and data: tokens/s and peak memory;
and the memory LoRA's implicit reference saves.

Each round runs, each in its own process (the order rotating per round), on the same
Hugging Face Llama folder (random weights, swift-mcore's 4,096-token tokenizer) and the
same preference pairs, fp32, global batch = micro-batch (one optimizer step per batch):

- swift-mcore: `swift-mcore rlhf --rlhf_type dpo` (its reference a frozen copy);
- trl: TRL's DPOTrainer (its reference a second model), dropout off, no gradient
  checkpointing (neither run recomputes);
- lora-implicit / lora-copy: `swift-mcore rlhf --tuner_type lora`, the reference the base
  with the adapters off, or the same base folder as --ref_model (a second copy).

tokens/s is the real (unpadded) tokens of the timed steps (the first --warmup left out)
over their time; peak memory is the process's maximum RSS. Prints one JSON line per run,
then one with the ratios (swift-mcore over TRL; LoRA implicit over copy).

    .venv/bin/python benchmarks/dpo_vs_trl.py                      # the 10m shape
    .venv/bin/python benchmarks/dpo_vs_trl.py --size tiny --rounds 1 --iters 3 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import tempfile

from bench_common import (SHAPES, random_llama_folder,  # puts the checkout on sys.path
                          rotate_rounds, run_swift_mcore, train_timed)

CONTENDERS = ("swift-mcore", "trl", "lora-implicit", "lora-copy")


def make_inputs(folder: str, size: str, pairs: int, words: int) -> str:
    """A random Llama folder of SHAPES[size] with swift-mcore's tokenizer, and prefs.jsonl."""
    model_dir = random_llama_folder(folder, size)
    rng = random.Random(0)
    vocab = ["the", "model", "answer", "data", "token", "layer", "value", "train", "prefer",
             "reward", "policy", "batch", "sample", "output", "input", "weight"]

    def text(n):
        return " ".join(rng.choice(vocab) for _ in range(n))

    data = os.path.join(folder, "prefs.jsonl")
    with open(data, "w") as fh:
        for _ in range(pairs):
            fh.write(json.dumps({"prompt": text(words // 2), "chosen": " " + text(words),
                                 "rejected": " " + text(words)}) + "\n")
    return model_dir


def run_ours(kind: str, model: str, data: str, args, out: str) -> dict:
    cmd = [sys.executable, "-m", "swift_mcore", "rlhf", "--model", model, "--dataset", data,
           "--seq_length", str(args.seq), "--micro_batch_size", str(args.batch),
           "--global_batch_size", str(args.batch), "--train_iters", str(args.iters),
           "--lr", "1e-5", "--log_interval", "1", "--eval_steps", "0", "--progress_bar",
           "false", "--report_to", "none", "--plot", "false", "--num_workers", "0",
           "--attention_backend", "sdpa", "--no_save", "--output_dir", out]
    if kind.startswith("lora"):
        cmd += ["--tuner_type", "lora", "--lora_rank", "8"]
    if kind == "lora-copy":
        cmd += ["--ref_model", model]
    rows, _steps, tokens_per_s = run_swift_mcore(kind, cmd, out, args.threads, args.warmup)
    return {"tokens_per_s": tokens_per_s, "loss_first": rows[1]["loss"]}


def run_trl(model: str, data: str, args, out: str) -> dict:
    """In this (child) process: TRL's DPOTrainer for --iters steps, timed per step."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(args.threads)
    load = dict(dtype=torch.float32, attn_implementation="sdpa")
    config = DPOConfig(output_dir=out, report_to=[], per_device_train_batch_size=args.batch,
                       max_length=args.seq + 1, max_steps=args.iters, learning_rate=1e-5,
                       lr_scheduler_type="constant", use_cpu=True, bf16=False,
                       gradient_checkpointing=False, logging_steps=1, save_strategy="no",
                       dataloader_num_workers=0, seed=0)
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model, **load),
                         ref_model=AutoModelForCausalLM.from_pretrained(model, **load),
                         args=config, train_dataset=load_dataset("json", data_files=data,
                                                                 split="train"),
                         processing_class=AutoTokenizer.from_pretrained(model))
    tokens_per_s, _steps = train_timed(trainer, lambda: trainer._total_train_tokens,
                                       args.warmup)
    return {"tokens_per_s": tokens_per_s}


def child(kind: str, model: str, data: str, args) -> None:
    with tempfile.TemporaryDirectory() as out:
        if kind == "trl":
            result = run_trl(model, data, args, out)
            rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        else:
            result = run_ours(kind, model, data, args, os.path.join(out, "run"))
            rss_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(json.dumps({"contender": kind, **result, "peak_rss_MB": round(rss_kb / 1024, 1)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="10m", choices=sorted(SHAPES))
    parser.add_argument("--seq", type=int, default=256, help="--seq_length (TRL max_length - 1)")
    parser.add_argument("--batch", type=int, default=4, help="pairs per step")
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--words", type=int, default=60, help="words per answer")
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS),
                        help="a subset (e.g. the two LoRA runs at 100m, whose reference copy "
                             "is large enough to show in the peak)")
    parser.add_argument("--child", choices=CONTENDERS)
    parser.add_argument("--model")
    parser.add_argument("--data")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.model, args.data, args)
        return
    chosen = tuple(args.contenders)
    with tempfile.TemporaryDirectory() as folder:
        model = make_inputs(folder, args.size, args.pairs, args.words)
        data = os.path.join(folder, "prefs.jsonl")
        passed = [a for a in sys.argv[1:]]
        if "--contenders" in passed:  # the children take one --child each
            at = passed.index("--contenders")
            passed = passed[:at] + passed[at + 1 + len(chosen):]
        results = rotate_rounds(__file__, passed, chosen, args.rounds,
                                ["--model", model, "--data", data])

    def median(kind, key):
        return statistics.median(x[key] for x in results[kind])

    summary = {"size": args.size, "seq": args.seq, "batch": args.batch}
    if {"swift-mcore", "trl"} <= set(chosen):
        summary.update(
            speed_ratio_vs_trl=round(median("swift-mcore", "tokens_per_s")
                                     / median("trl", "tokens_per_s"), 3),
            memory_ratio_vs_trl=round(median("swift-mcore", "peak_rss_MB")
                                      / median("trl", "peak_rss_MB"), 3))
    if {"lora-implicit", "lora-copy"} <= set(chosen):
        summary["lora_implicit_reference_saves_MB"] = round(
            median("lora-copy", "peak_rss_MB") - median("lora-implicit", "peak_rss_MB"), 1)
    summary.update({f"{k}_tokens_per_s": round(median(k, "tokens_per_s"), 1) for k in chosen})
    summary.update({f"{k}_peak_rss_MB": median(k, "peak_rss_MB") for k in chosen})
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
