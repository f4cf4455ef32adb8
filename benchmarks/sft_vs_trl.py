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
import subprocess
import sys
import tempfile
import time

from bench_common import ROOT, SHAPES, child_env  # puts the checkout on sys.path

CONTENDERS = ("swift-mcore", "trl", "swift-mcore-lora", "peft-lora")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if "
          "add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LORA_RANK, LORA_ALPHA = 8, 32
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_inputs(folder: str, size: str, rows: int, words: int) -> str:
    """A random Llama folder of SHAPES[size] with swift-mcore's tokenizer (and a ChatML
    chat template), and chats.jsonl."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from swift_mcore.data import default_tokenizer

    s = SHAPES[size]
    tokenizer = default_tokenizer()
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=s["hidden_size"],
        intermediate_size=-(-int(8 * s["hidden_size"] / 3) // 64) * 64,
        num_hidden_layers=s["num_layers"], num_attention_heads=s["num_attention_heads"],
        num_key_value_heads=s["num_query_groups"], max_position_embeddings=4096,
        tie_word_embeddings=False, eos_token_id=tokenizer.eod, pad_token_id=tokenizer.eod)
    torch.manual_seed(0)
    model_dir = os.path.join(folder, "model")
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    path = os.path.join(model_dir, "tokenizer_config.json")
    with open(path, encoding="utf-8") as fh:
        settings = json.load(fh)
    settings["chat_template"] = CHATML
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(settings, fh, indent=1)
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
                str(LORA_ALPHA)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env=child_env(OMP_NUM_THREADS=str(args.threads)))
    if proc.returncode != 0:
        sys.exit(f"{kind} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps = [r for r in rows if r.get("split") == "train"][args.warmup:]
    seconds = sum(r["tokens"] / r["tokens_per_s"] for r in steps if r["tokens_per_s"])
    return {"tokens_per_s": sum(r["tokens"] for r in steps) / max(seconds, 1e-9),
            "steps_timed": len(steps)}


def run_trl(kind: str, model: str, data: str, args, out: str) -> dict:
    """In this (child) process: TRL's SFTTrainer for --iters steps, timed per step."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
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

        peft_config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                 target_modules=TARGETS, task_type="CAUSAL_LM")
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32,
                                                   attn_implementation="sdpa"),
        args=config, train_dataset=load_dataset("json", data_files=data, split="train"),
        processing_class=AutoTokenizer.from_pretrained(model), peft_config=peft_config)
    times, tokens = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start, self.tokens = time.perf_counter(), trainer.state.num_input_tokens_seen

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)
            tokens.append(trainer.state.num_input_tokens_seen - self.tokens)

    trainer.add_callback(Timer())
    trainer.train()
    timed = slice(args.warmup, None)
    return {"tokens_per_s": sum(tokens[timed]) / max(sum(times[timed]), 1e-9),
            "steps_timed": len(times[timed])}


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
    results = {k: [] for k in chosen}
    with tempfile.TemporaryDirectory() as folder:
        model = make_inputs(folder, args.size, args.rows, args.words)
        data = os.path.join(folder, "chats.jsonl")
        for r in range(args.rounds):
            order = chosen[r % len(chosen):] + chosen[:r % len(chosen)]
            for kind in order:
                proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child",
                                       kind, "--model", model, "--data", data],
                                      capture_output=True, text=True, cwd=ROOT,
                                      env=child_env(PYTHONWARNINGS="ignore"))
                if proc.returncode != 0:
                    sys.exit(f"{kind} failed:\n{proc.stderr[-3000:]}")
                line = json.loads(proc.stdout.strip().splitlines()[-1])
                print(json.dumps({"round": r, **line}), flush=True)
                results[kind].append(line)

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
