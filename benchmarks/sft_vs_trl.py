"""sft with packing against TRL 1.16's SFTTrainer (padding-free packing), and swift-mcore LoRA against transformers + peft LoRA: steady-state tokens/s, as ratios in one run.

Each round runs, each in its own process (the order rotating per round), on the same
Hugging Face Llama folder (random weights, swift-mcore's 4,096-token tokenizer with a
ChatML chat template) and the same conversations, fp32, --seq rows of --batch per step
(one optimizer step per batch):

- swift-mcore: `swift-mcore sft --packing --template tokenizer` (full finetuning);
- trl: TRL's SFTTrainer, packing="bfd" (best-fit decreasing; padding-free: the packed
  rows go through the model flattened, with position ids restarting per conversation),
  max_length --seq, dropout off, no gradient checkpointing;
- swift-mcore-lora: the same with `--tuner_type lora --lora_rank 8 --lora_alpha 32`;
- peft-lora: TRL's SFTTrainer with a peft LoraConfig of the same rank, alpha and target
  modules (every linear layer of the decoder: q, k, v, o, gate, up, down).

tokens/s is the real (unpadded) tokens of the timed steps (the first --warmup left out)
over their time. Prints one JSON line per run, then one with the ratios (swift-mcore over
TRL, swift-mcore LoRA over peft LoRA); on a loaded machine only the ratios mean much.

    .venv/bin/python benchmarks/sft_vs_trl.py                      # the 10m shape
    .venv/bin/python benchmarks/sft_vs_trl.py --size tiny --rounds 1 --iters 3 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile

from bench_common import (SHAPES, random_llama_folder,  # puts the checkout on sys.path
                          rotate_rounds, run_swift_mcore, train_timed)

CONTENDERS = ("swift-mcore", "trl", "swift-mcore-lora", "peft-lora")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if "
          "add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LORA_RANK, LORA_ALPHA = 8, 32
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_inputs(folder: str, size: str, rows: int, words: int) -> str:
    """A random Llama folder of SHAPES[size] with swift-mcore's tokenizer (and a ChatML
    chat template), and chats.jsonl."""
    model_dir = random_llama_folder(folder, size, CHATML)
    rng = random.Random(0)
    vocab = ["the", "model", "answer", "data", "token", "layer", "value", "train", "question",
             "reason", "policy", "batch", "sample", "output", "input", "weight"]

    def text(n):
        return " ".join(rng.choice(vocab) for _ in range(n))

    with open(os.path.join(folder, "chats.jsonl"), "w") as fh:
        for _ in range(rows):
            n = rng.randint(words // 4, words)
            fh.write(json.dumps({"messages": [
                {"role": "user", "content": text(max(1, n // 3))},
                {"role": "assistant", "content": text(n)}]}) + "\n")
    return model_dir


def run_ours(kind: str, model: str, data: str, args, out: str) -> dict:
    cmd = [sys.executable, "-m", "swift_mcore", "sft", "--model", model, "--dataset", data,
           "--template", "tokenizer", "--packing", "--seq_length", str(args.seq),
           "--micro_batch_size", str(args.batch), "--global_batch_size", str(args.batch),
           "--train_iters", str(args.iters), "--lr", "1e-5", "--lr_warmup_iters", "0",
           "--log_interval", "1", "--eval_steps", "0", "--progress_bar", "false",
           "--report_to", "none", "--plot", "false", "--num_workers", "0",
           "--attention_backend", "sdpa", "--no_save", "--output_dir", out]
    if kind == "swift-mcore-lora":
        cmd += ["--tuner_type", "lora", "--lora_rank", str(LORA_RANK), "--lora_alpha",
                str(LORA_ALPHA), "--lora_dropout", str(args.lora_dropout)]
    _rows, steps, tokens_per_s = run_swift_mcore(kind, cmd, out, args.threads, args.warmup)
    return {"tokens_per_s": tokens_per_s, "steps_timed": len(steps)}


def run_trl(kind: str, model: str, data: str, args, out: str) -> dict:
    """In this (child) process: TRL's SFTTrainer for --iters steps, timed per step."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(args.threads)
    config = SFTConfig(output_dir=out, report_to=[], per_device_train_batch_size=args.batch,
                       max_length=args.seq, packing=True, packing_strategy="bfd",
                       padding_free=True, max_steps=args.iters, learning_rate=1e-5,
                       lr_scheduler_type="constant", use_cpu=True, bf16=False,
                       gradient_checkpointing=False, logging_steps=1, save_strategy="no",
                       dataloader_num_workers=0, seed=0, include_num_input_tokens_seen="all")
    peft_config = None
    if kind == "peft-lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA,
                                 lora_dropout=args.lora_dropout,
                                 target_modules=TARGETS, task_type="CAUSAL_LM")
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32,
                                                   attn_implementation="sdpa"),
        args=config, train_dataset=load_dataset("json", data_files=data, split="train"),
        processing_class=AutoTokenizer.from_pretrained(model), peft_config=peft_config)
    tokens_per_s, steps = train_timed(trainer, lambda: trainer.state.num_input_tokens_seen,
                                      args.warmup)
    return {"tokens_per_s": tokens_per_s, "steps_timed": steps}


def child(kind: str, model: str, data: str, args) -> None:
    with tempfile.TemporaryDirectory() as out:
        if kind.startswith("swift-mcore"):
            result = run_ours(kind, model, data, args, os.path.join(out, "run"))
        else:
            result = run_trl(kind, model, data, args, out)
    print(json.dumps({"contender": kind, **result}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="10m", choices=sorted(SHAPES))
    parser.add_argument("--seq", type=int, default=512, help="--seq_length (TRL max_length)")
    parser.add_argument("--batch", type=int, default=4, help="packed rows per step")
    parser.add_argument("--rows", type=int, default=2000, help="conversations")
    parser.add_argument("--words", type=int, default=120, help="most words per answer")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lora_dropout", type=float, default=0.05,
                        help="both LoRA contenders' adapter dropout (0.05: ms-swift's and "
                             "swift-mcore's default)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help="which of them, comma-separated (the ratios need their pairs)")
    parser.add_argument("--child", choices=CONTENDERS)
    parser.add_argument("--model")
    parser.add_argument("--data")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.model, args.data, args)
        return
    chosen = tuple(k for k in CONTENDERS if k in args.contenders.split(","))
    unknown = set(args.contenders.split(",")) - set(CONTENDERS)
    if unknown or not chosen:
        parser.error(f"--contenders: unknown {sorted(unknown)}; choose from {CONTENDERS}")
    with tempfile.TemporaryDirectory() as folder:
        model = make_inputs(folder, args.size, args.rows, args.words)
        data = os.path.join(folder, "chats.jsonl")
        results = rotate_rounds(__file__, sys.argv[1:], chosen, args.rounds,
                                ["--model", model, "--data", data])

    def median(kind):
        return statistics.median(x["tokens_per_s"] for x in results[kind])

    ratios = {name: round(median(a) / median(b), 3) for name, a, b in (
        ("speed_ratio_vs_trl", "swift-mcore", "trl"),
        ("lora_speed_ratio_vs_peft", "swift-mcore-lora", "peft-lora"),
        ("lora_over_full", "swift-mcore-lora", "swift-mcore")) if a in results and b in results}
    print(json.dumps({
        "size": args.size, "seq": args.seq, "batch": args.batch, **ratios,
        **{f"{k}_tokens_per_s": round(median(k), 1) for k in chosen},
    }), flush=True)


if __name__ == "__main__":
    main()
