"""Qwen3.5 dense text model (``Qwen3_5ForCausalLM``, model_type qwen3_5_text): Qwen3-Next's
layers (gated delta nets among gated full attention, zero-centred norms, partial RoPE) with
a dense SwiGLU MLP; its delta nets keep four input projections (models/delta_net.py)."""

from .base import require
from .qwen3_next import DEFAULTS, Qwen3NextFamily

FAMILY = Qwen3NextFamily(
    name="qwen3_5",
    # the multimodal folder's type: its language model trains alone (models/text_part.py)
    model_types=("qwen3_5_text", "qwen3_5"),
    architecture="Qwen3_5ForCausalLM",
    # transformers' Qwen3_5TextConfig defaults for keys a config.json may omit
    defaults={**DEFAULTS, "vocab_size": 248_320, "hidden_size": 4096, "intermediate_size": 12288,
              "num_hidden_layers": 32, "num_key_value_heads": 4},
    fixed={"qk_layernorm": True, "attention_output_gate": True},
    known_keys=frozenset({"attention_bias"}),
    checks=require(attention_bias=False),
    mtp=True,  # mtp_num_hidden_layers: its MTP layer under mtp.* (models/mtp.py)
)
