"""Qwen3.5-MoE text model (``Qwen3_5MoeForCausalLM``, model_type qwen3_5_moe_text): Qwen3.5's
layers with routed experts (top-k always renormalised) and a sigmoid-gated shared expert in
every layer."""

from .base import MoeKeys, require
from .qwen3_next import DEFAULTS, Qwen3NextFamily

FAMILY = Qwen3NextFamily(
    name="qwen3_5_moe",
    # the multimodal folder's type: its language model trains alone (models/text_part.py)
    model_types=("qwen3_5_moe_text", "qwen3_5_moe"),
    architecture="Qwen3_5MoeForCausalLM",
    # transformers' Qwen3_5MoeTextConfig defaults for keys a config.json may omit
    # (no intermediate_size: every layer is MoE)
    defaults={**DEFAULTS, "vocab_size": 248_320, "num_hidden_layers": 40, "intermediate_size": None,
              "num_key_value_heads": 2, "num_experts_per_tok": 8},
    fixed={"qk_layernorm": True, "attention_output_gate": True},
    known_keys=frozenset({"attention_bias"}),
    checks=require(attention_bias=False),
    mtp=True,  # mtp_num_hidden_layers: its MTP layer under mtp.* (models/mtp.py)
    moe=MoeKeys(experts=("num_experts",), expert_ffn="moe_intermediate_size",
                shared_ffn="shared_expert_intermediate_size", dense_layers=False,
                norm_topk=None),
)
