"""What the benchmark scripts share: the checkout on sys.path, and the model shapes they measure.

Importing it puts the repository root first on ``sys.path`` (so the checkout's swift_mcore is
the one measured, not an installed copy) and ``benchmarks/`` after it (scripts import each
other's pieces). A script run as ``python benchmarks/NAME.py`` finds this module because its
own folder is already on the path.
"""

from __future__ import annotations

import os
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
