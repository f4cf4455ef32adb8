"""GLM-4.5 / GLM-4.6 (``Glm4MoeForCausalLM``): grouped-query attention with partial rotary
(half of each head's channels by default), optional bias on q/k/v and per-head q/k norm,
and DeepSeek-V3's sigmoid router with its expert bias, shared experts and dense first
layers (sigmoid_moe.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from . import sigmoid_moe
from .sigmoid_moe import SigmoidMoeFamily

# transformers' Glm4MoeConfig defaults for keys a config.json may omit
DEFAULTS = {"hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tie_word_embeddings": False, "moe_intermediate_size": 1408,
            "num_experts_per_tok": 8, "n_shared_experts": 1, "n_routed_experts": 128,
            "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
            "first_k_dense_replace": 1, "norm_topk_prob": True, "partial_rotary_factor": 0.5,
            "attention_bias": False, "use_qk_norm": False}
KEYS = frozenset({"attention_bias", "use_qk_norm", "partial_rotary_factor"})
# the flags the generic representation check assumes and GLM sets from its config.json
_OWN_FLAGS = ("--rotary_percent", "--add_qkv_bias", "--qk_layernorm")


@dataclass(frozen=True)
class Glm4MoeFamily(SigmoidMoeFamily):

    def generic_config(self, config: Dict[str, Any]) -> Dict[str, Any]:
        # partial rotary is mapped in attention_values (the generic part takes 1.0 only)
        return {k: v for k, v in config.items() if k != "partial_rotary_factor"}

    def attention_values(self, config: Dict[str, Any], get) -> tuple:
        # transformers reads a given rope_scaling in place of rope_parameters
        rope = next((config[k] for k in ("rope_scaling", "rope_parameters")
                     if isinstance(config.get(k), dict) and config[k]), None) or {}
        partial = rope.get("partial_rotary_factor", get("partial_rotary_factor"))
        problems: List[str] = []
        if isinstance(partial, bool) or not isinstance(partial, (int, float)) \
                or not 0 < partial <= 1:
            problems.append(f"partial_rotary_factor {partial!r} (above 0, at most 1)")
            partial = 1.0
        if "head_dim" in config and config["head_dim"] is None:
            # transformers' Glm4MoeAttention takes head_dim as it is (its RoPE would not)
            problems.append("head_dim null (a number, or no head_dim key for hidden_size / "
                            "num_attention_heads)")
        return {"rotary_percent": float(partial), "add_qkv_bias": bool(get("attention_bias")),
                "qk_layernorm": bool(get("use_qk_norm"))}, problems

    def representation_problems(self, m: Any) -> List[str]:
        return [p for p in super().representation_problems(m) if not p.startswith(_OWN_FLAGS)]

    def hf_config(self, m: Any, vocab_size: int, base: Optional[Dict[str, Any]] = None
                  ) -> Dict[str, Any]:
        config = super().hf_config(m, vocab_size, base)
        config.pop("partial_rotary_factor", None)
        config["rope_parameters"]["partial_rotary_factor"] = m.rotary_percent
        config.update(attention_bias=m.add_qkv_bias, use_qk_norm=m.qk_layernorm)
        return config


FAMILY = Glm4MoeFamily(
    name="glm4_moe",
    model_types=("glm4_moe",),
    architecture="Glm4MoeForCausalLM",
    defaults=DEFAULTS,
    fixed=dict(sigmoid_moe.FIXED),
    known_keys=KEYS,
    moe=sigmoid_moe.MOE,
    mtp=True,  # num_nextn_predict_layers MTP layers past num_hidden_layers (models/mtp.py)
)
