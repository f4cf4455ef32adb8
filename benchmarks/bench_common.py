"""What the benchmark scripts share: the checkout on sys.path, and the model shapes they measure.

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
