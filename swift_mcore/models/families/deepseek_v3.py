"""DeepSeek-V3 (``DeepseekV3ForCausalLM``; Moonlight and the other folders of its
architecture): multi-latent attention with YaRN RoPE, a sigmoid router whose expert bias
(``e_score_correction_bias``) steers the choice only, group-limited top-k, routed weights
scaled by ``routed_scaling_factor``, ungated shared experts and dense first layers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from . import sigmoid_moe
from .base import require, value_problems
from .sigmoid_moe import SigmoidMoeFamily

# transformers' DeepseekV3Config defaults for keys a config.json may omit
DEFAULTS = {"hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "tie_word_embeddings": False, "moe_intermediate_size": 2048,
            "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
            "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
            "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True}
# keys read here beyond base.MAPPED_KEYS and the router's (sigmoid_moe.py)
KEYS = frozenset({"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "qk_head_dim", "v_head_dim", "rope_interleave", "attention_bias",
                  "pretraining_tp"})
_ROPE = ("rope_parameters", "rope_scaling")


@dataclass(frozen=True)
class DeepseekFamily(SigmoidMoeFamily):
    """The sigmoid router's family (sigmoid_moe.py) with multi-latent attention and YaRN."""

    def generic_config(self, config: Dict[str, Any]) -> Dict[str, Any]:
        # the generic part reads the RoPE base only; YaRN is mapped in attention_values
        plain = {k: v for k, v in config.items() if k not in _ROPE}
        rope = _rope(config)
        if rope.get("rope_theta") is not None:
            plain["rope_theta"] = rope["rope_theta"]
        return plain

    def attention_values(self, config: Dict[str, Any], get) -> tuple:
        invalid = value_problems(config, _ROPE)  # generic_config hid them from the common check
        if invalid:
            return {}, invalid
        values, problems = _mla_values(config, _rope(config), get)
        heads = int(config["num_attention_heads"])
        rope_dim = int(get("qk_rope_head_dim"))
        if config.get("head_dim") is not None and config["head_dim"] != rope_dim:
            # transformers rotates head_dim channels of each head's qk_rope_head_dim
            problems.append(f"head_dim {config['head_dim']} (the rotary part of a head: only "
                            f"qk_rope_head_dim {rope_dim}, or no head_dim)")
        if int(get("num_key_value_heads") or heads) != heads:
            problems.append(f"num_key_value_heads {config['num_key_value_heads']} (multi-latent "
                            f"attention has one key/value per head: {heads})")
        return values, problems

    def representation_problems(self, m: Any) -> List[str]:
        problems = super().representation_problems(m)
        if m.num_query_groups not in (None, m.num_attention_heads):
            problems.append(f"--num_query_groups {m.num_query_groups} (MLA: one per head)")
        return problems

    def hf_config(self, m: Any, vocab_size: int, base: Optional[Dict[str, Any]] = None
                  ) -> Dict[str, Any]:
        config = super().hf_config(m, vocab_size, base)
        for key in ("head_dim", "rope_scaling"):
            config.pop(key, None)
        rope: Dict[str, Any] = {"rope_type": "default", "rope_theta": float(m.rotary_base)}
        if m.rope_type == "yarn":
            rope.update(rope_type="yarn", factor=m.rotary_scaling_factor,
                        original_max_position_embeddings=m.original_max_position_embeddings,
                        beta_fast=m.beta_fast, beta_slow=m.beta_slow, mscale=m.mscale,
                        mscale_all_dim=m.mscale_all_dim)
        config.update(
            num_key_value_heads=m.num_attention_heads, q_lora_rank=m.q_lora_rank,
            kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_head_dim,
            qk_rope_head_dim=m.qk_pos_emb_head_dim,
            qk_head_dim=m.qk_head_dim + m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
            rope_interleave=True, attention_bias=False, rope_parameters=rope)
        return config


def _rope(config: Dict[str, Any]) -> Dict[str, Any]:
    # transformers reads a given rope_scaling in place of rope_parameters
    # (``rope_scaling or rope_parameters``)
    return next((config[k] for k in ("rope_scaling", "rope_parameters")
                 if isinstance(config.get(k), dict) and config[k]), None) or {}


def _mla_values(config: Dict[str, Any], rope: Dict[str, Any], get) -> tuple:
    """(MLA and RoPE ModelArguments values, problems) of a DeepSeek-V3 config.json."""
    problems: List[str] = []
    if get("rope_interleave") is False:
        problems.append("rope_interleave false (megatron's MLA rotates interleaved channel "
                        "pairs, as transformers does with rope_interleave true)")
    values: Dict[str, Any] = dict(
        multi_latent_attention=True, qk_layernorm=True,
        q_lora_rank=None if get("q_lora_rank") is None else int(get("q_lora_rank")),
        kv_lora_rank=int(get("kv_lora_rank")), qk_head_dim=int(get("qk_nope_head_dim")),
        qk_pos_emb_head_dim=int(get("qk_rope_head_dim")), v_head_dim=int(get("v_head_dim")),
        rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    if "q_lora_rank" in config and config["q_lora_rank"] is None:
        values["q_lora_rank"] = None  # null is a choice here: queries projected directly
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if kind == "default":
        return values, problems
    if kind != "yarn":
        return values, problems + [f"rope_parameters.rope_type {kind!r} (supported: 'default', "
                                   f"'yarn')"]
    for key in ("attention_factor",):
        if rope.get(key) is not None:
            problems.append(f"rope_parameters.{key} (megatron's YaRN derives it from mscale)")
    if rope.get("truncate") is False:
        problems.append("rope_parameters.truncate false (megatron's YaRN rounds the "
                        "correction range)")
    for name in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                 "mscale", "mscale_all_dim"):
        value = rope.get(name)
        positive = name in ("factor", "original_max_position_embeddings")
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value < 0
                                  or (positive and value == 0)):
            problems.append(f"rope_parameters.{name} {value!r} (a number, "
                            f"{'above' if positive else 'at least'} 0)")
    if problems:
        return values, problems
    original = rope.get("original_max_position_embeddings")
    if original is None:
        return values, problems + ["rope_parameters.original_max_position_embeddings is "
                                   "missing for rope_type 'yarn'"]
    factor = rope.get("factor") or get("max_position_embeddings") / original
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if all_dim and not mscale:
        problems.append(f"rope_parameters.mscale_all_dim {all_dim} without mscale (megatron "
                        f"scales the rotary embedding by mscale / mscale_all_dim)")
    both = bool(mscale and all_dim)
    values.update(rope_type="yarn", rotary_scaling_factor=float(factor),
                  original_max_position_embeddings=int(original),
                  beta_fast=float(rope.get("beta_fast") or 32),
                  beta_slow=float(rope.get("beta_slow") or 1),
                  mscale=float(mscale) if both else 1.0,
                  mscale_all_dim=float(all_dim) if both else 0.0)
    return values, problems


FAMILY = DeepseekFamily(
    name="deepseek_v3",
    # kimi_k2 (Kimi-K2, Moonlight's successors) is the same architecture under its own name
    model_types=("deepseek_v3", "kimi_k2"),
    architecture="DeepseekV3ForCausalLM",
    defaults=DEFAULTS,
    fixed={"multi_latent_attention": True, "qk_layernorm": True, **sigmoid_moe.FIXED},
    known_keys=KEYS,
    checks=require(attention_bias=False, moe_layer_freq=1),
    moe=sigmoid_moe.MOE,
    mtp=True,  # num_nextn_predict_layers MTP layers past num_hidden_layers (models/mtp.py)
)
