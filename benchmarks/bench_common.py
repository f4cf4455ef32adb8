"""What the benchmark scripts share: the checkout on sys.path, the model shapes they measure, and the driver of the runs against other trainers.

Importing it puts the repository root first on ``sys.path`` (so the checkout's swift_mcore is
the one measured, not an installed copy) and ``benchmarks/`` after it (scripts import each
other's pieces). A script run as ``python benchmarks/NAME.py`` finds this module because its
own folder is already on the path.
"""

from __future__ import annotations

import os
import subprocess
import sys

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCHMARKS)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCHMARKS)


def on_path(*parts: str) -> None:
    """Puts ROOT/parts first on sys.path: the test helpers a benchmark reuses
    (``on_path("tests", "checkpointing")``)."""
    sys.path.insert(0, os.path.join(ROOT, *parts))


# The model shapes the tables of benchmarks/README.md name, as keyword flags.
SHAPES = {
    # 9.4M parameters with the default 4096-token vocabulary.
    "10m": dict(num_layers=4, hidden_size=384, num_attention_heads=6, num_query_groups=2),
    # 97M parameters.
    "100m": dict(num_layers=8, hidden_size=1024, num_attention_heads=16, num_query_groups=4),
    # The 10m model with Qwen2.5's vocabulary (151,936 rows, 126M parameters): the output
    # layer and the loss dominate memory ([tokens, 151936] fp32 logits per micro-batch).
    # The rows are still the 4,096-token corpus's.
    "vocab152k": dict(num_layers=4, hidden_size=384, num_attention_heads=6, num_query_groups=2,
                      vocab_size=151936),
    # The smoke tests' size.
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2),
}
# Llama-style layers: SwiGLU, RMSNorm, RoPE, untied embeddings (grouped-query attention is
# in the shapes).
LLAMA_SETTINGS = dict(swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                      untie_embeddings_and_output_weights=True)


def flags(**values) -> list[str]:
    """Keyword settings as CLI flags, in order: ``flags(num_layers=2, swiglu=True)`` is
    ``["--num_layers", "2", "--swiglu", "true"]``."""
    out = []
    for name, value in values.items():
        out += [f"--{name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return out


SIZES = {name: flags(**shape) for name, shape in SHAPES.items()}
LLAMA = flags(**LLAMA_SETTINGS)


# torchrun's variables: a benchmark's child process is a run of its own, not a rank of the
# process that started it.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def child_env(**settings: str) -> dict:
    """This process's environment without the launch variables, with ``settings`` added."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env.update(settings)
    return env


def print_child_result(name: str, argv: list, env: dict) -> None:
    """Runs ``python ARGV`` in ROOT and prints the last line of its stdout (the child's JSON
    record); a failed child stops the benchmark with its name and the end of its stderr."""
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT,
                          env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-4000:]}")
    print(proc.stdout.strip().splitlines()[-1], flush=True)


# ---- swift-mcore against a Hugging Face trainer (sft_vs_trl.py, dpo_vs_trl.py) -------------

def random_llama_folder(folder: str, size: str, chat_template: str | None = None) -> str:
    """``folder``/model: a Llama of SHAPES[size] with random weights (seed 0) and
    swift-mcore's tokenizer (with ``chat_template`` in its tokenizer_config.json)."""
    import json

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
    if chat_template is not None:
        path = os.path.join(model_dir, "tokenizer_config.json")
        with open(path, encoding="utf-8") as fh:
            settings = json.load(fh)
        settings["chat_template"] = chat_template
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(settings, fh, indent=1)
    return model_dir


def run_swift_mcore(kind: str, cmd: list, out: str, threads: int, warmup: int):
    """Runs ``cmd`` (a swift-mcore run writing to ``out``) with ``threads`` threads; returns
    its metrics.jsonl rows and the tokens/s of its train steps after the first ``warmup``
    (the tokens of those steps over their time)."""
    import json

    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env=child_env(OMP_NUM_THREADS=str(threads)))
    if proc.returncode != 0:
        sys.exit(f"{kind} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps = [r for r in rows if r.get("split") == "train"][warmup:]
    seconds = sum(r["tokens"] / r["tokens_per_s"] for r in steps if r["tokens_per_s"])
    return rows, steps, sum(r["tokens"] for r in steps) / max(seconds, 1e-9)


def train_timed(trainer, tokens_seen, warmup: int):
    """Trains a transformers ``trainer``, timing each step; returns the steps after the first
    ``warmup``: their tokens (``tokens_seen()`` counts them so far) over their time, and
    how many."""
    import time

    from transformers import TrainerCallback

    times, tokens = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start, self.tokens = time.perf_counter(), tokens_seen()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)
            tokens.append(tokens_seen() - self.tokens)

    trainer.add_callback(Timer())
    trainer.train()
    timed = slice(warmup, None)
    return sum(tokens[timed]) / max(sum(times[timed]), 1e-9), len(times[timed])


def rotate_rounds(script: str, argv: list, contenders: tuple, rounds: int,
                  child_args: list) -> dict:
    """Runs ``python SCRIPT ARGV --child KIND CHILD_ARGS`` for every contender, ``rounds``
    times, each in its own process, the order rotating by one per round; prints each
    child's JSON line (with its round) and returns {kind: [its JSON lines]}."""
    import json

    results = {k: [] for k in contenders}
    for r in range(rounds):
        order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
        for kind in order:
            proc = subprocess.run([sys.executable, script, *argv, "--child", kind,
                                   *child_args],
                                  capture_output=True, text=True, cwd=ROOT,
                                  env=child_env(PYTHONWARNINGS="ignore"))
            if proc.returncode != 0:
                sys.exit(f"{kind} failed:\n{proc.stderr[-3000:]}")
            line = json.loads(proc.stdout.strip().splitlines()[-1])
            print(json.dumps({"round": r, **line}), flush=True)
            results[kind].append(line)
    return results
