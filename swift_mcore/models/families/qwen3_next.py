"""Qwen3-Next (``Qwen3NextForCausalLM``): gated delta-net (linear attention) layers among
gated full-attention layers (partial RoPE, per-head q/k norms, a sigmoid output gate),
zero-centred RMSNorms, routed experts with a sigmoid-gated shared expert
(models/hybrid_layers.py, models/delta_net.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from .base import InvalidConfig, MoeKeys, UnsupportedConfig, require, value_problems
from .text_model import TextModelFamily

LINEAR, FULL = "linear_attention", "full_attention"
# config.json key -> ModelArguments flag of the delta-net shapes
LINEAR_KEYS = {"linear_conv_kernel_dim": "linear_conv_kernel_dim",
               "linear_key_head_dim": "linear_key_head_dim",
               "linear_value_head_dim": "linear_value_head_dim",
               "linear_num_key_heads": "linear_num_key_heads",
               "linear_num_value_heads": "linear_num_value_heads"}
# keys read here and hidden from the common reader
OWN_KEYS = ("layer_types", "full_attention_interval", "partial_rotary_factor",
            "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", *LINEAR_KEYS)
# transformers' Qwen3NextConfig defaults for keys a config.json may omit
DEFAULTS = {"vocab_size": 151_936, "hidden_size": 2048, "intermediate_size": 5632,
            "num_hidden_layers": 48, "num_attention_heads": 16, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "hidden_act": "silu",
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "head_dim": 256, "num_key_value_heads": 2,
            "partial_rotary_factor": 0.25, "full_attention_interval": 4,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_num_key_heads": 16,
            "linear_num_value_heads": 32}


def layer_kinds(config: Dict[str, Any]) -> tuple:
    """Each layer's kind and the problems found: from layer_types, else every
    full_attention_interval-th layer (counting from 1) is full attention."""
    layers = int(config["num_hidden_layers"])
    kinds = config.get("layer_types")
    if kinds is not None:
        bad = sorted({k for k in kinds if k not in (LINEAR, FULL)})
        if bad or len(kinds) != layers:
            return [], [f"layer_types {kinds!r} ({layers} entries of '{LINEAR}' or "
                        f"'{FULL}')"]
        return list(kinds), []
    every = config.get("full_attention_interval") or DEFAULTS["full_attention_interval"]
    return [FULL if (i + 1) % int(every) == 0 else LINEAR for i in range(layers)], []


def rotary_fraction(config: Dict[str, Any]) -> Any:
    """partial_rotary_factor: inside rope_parameters (transformers 5) or at the top."""
    # rope_scaling, when given, stands in for rope_parameters (base.rope_settings)
    params = config.get("rope_scaling") or config.get("rope_parameters")
    if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
        return params["partial_rotary_factor"]
    value = config.get("partial_rotary_factor")
    return DEFAULTS["partial_rotary_factor"] if value is None else value


@dataclass(frozen=True)
class Qwen3NextFamily(TextModelFamily):
    """Family with Qwen3-Next's own reading and writing of config.json."""

    own_keys = OWN_KEYS

    def text_model_values(self, config: Dict[str, Any], model_args: Any) -> Dict[str, Any]:
        if "text_config" in config:
            raise UnsupportedConfig(
                f"model_type {config.get('model_type')!r} (the vision-language model, its text "
                f"model under text_config) is not supported yet; give a folder of the text "
                f"model alone (model_type {self.model_types[0]!r}, {self.architecture})")
        invalid = value_problems(config, self.read_keys())
        if invalid:
            raise InvalidConfig("; ".join(invalid))
        problems: List[str] = []
        kinds, found = layer_kinds(config) if config.get("num_hidden_layers") else ([], [])
        problems += found
        if (config.get("mtp_num_hidden_layers") or 0) > 1:
            problems.append(f"mtp_num_hidden_layers {config['mtp_num_hidden_layers']} (its MTP "
                            f"layers share one fc and its norms, megatron's MTP layers have "
                            f"their own: 0 or 1)")
        elif config.get("mtp_use_dedicated_embeddings"):
            problems.append("mtp_use_dedicated_embeddings true (megatron's MTP layer shares "
                            "the model's embedding: only false)")
        else:
            from .. import mtp

            mtp.check_flag(self, model_args)  # its MTP layer (mtp.* in the weights)
        fraction = rotary_fraction(config)
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
                or not 0 < fraction <= 1:
            problems.append(f"partial_rotary_factor {fraction!r} (a number above 0, at most 1)")
        shapes = {key: config.get(key) if config.get(key) is not None else DEFAULTS[key]
                  for key in LINEAR_KEYS}
        if LINEAR in kinds and shapes["linear_num_value_heads"] % \
                shapes["linear_num_key_heads"]:
            problems.append(f"linear_num_value_heads {shapes['linear_num_value_heads']} (a "
                            f"multiple of linear_num_key_heads "
                            f"{shapes['linear_num_key_heads']})")
        core = {k: v for k, v in config.items() if k not in OWN_KEYS}
        if self.moe is not None and not self.moe.dense_layers \
                and core.get("intermediate_size") is None:
            # every layer is MoE (Qwen3.5-MoE): no dense MLP size in config.json
            core["intermediate_size"] = core.get("moe_intermediate_size") or \
                self.defaults.get("moe_intermediate_size")
        for key in ("rope_parameters", "rope_scaling"):
            if isinstance(core.get(key), dict):
                core[key] = {k: v for k, v in core[key].items() if k != "partial_rotary_factor"}
        values = self.common_values(core, model_args, problems)
        head_dim = values["kv_channels"]
        if (head_dim * float(fraction)) % 2:
            raise UnsupportedConfig(f"partial_rotary_factor {fraction} (head_dim {head_dim} "
                                    f"times it must be an even number of channels)")
        values.update({flag: int(shapes[key]) for key, flag in LINEAR_KEYS.items()})
        values.update(
            rotary_percent=float(fraction),
            linear_attention_freq=("[" + ",".join("1" if k == LINEAR else "0" for k in kinds)
                                   + "]") if LINEAR in kinds else None,
        )
        return values

    def representation_problems(self, m: Any) -> List[str]:
        own = ("--rotary_percent ", "--linear_attention_freq ")
        problems = [p for p in super().representation_problems(m) if not p.startswith(own)]
        if (m.mtp_num_layers or 0) > 1:
            problems.append(f"--mtp_num_layers {m.mtp_num_layers} (a {self.name} folder holds "
                            f"one multi-token prediction layer at most)")
        if m.model_type != self.name:
            # its norms are built for --model_type qwen3_next only
            problems.append(f"--model_type {m.model_type} (a {self.name} model is built with "
                            f"--model_type {self.name})")
        return problems

    def hf_config(self, m: Any, vocab_size: int, base: Optional[Dict[str, Any]] = None
                  ) -> Dict[str, Any]:
        from ...arguments.model import linear_attention_pattern

        base = {k: v for k, v in (base or {}).items()
                if k not in ("full_attention_interval", "partial_rotary_factor")}
        config = super().hf_config(m, vocab_size, base)
        config["rope_parameters"]["partial_rotary_factor"] = float(m.rotary_percent)
        pattern = linear_attention_pattern(m) or [0] * m.num_layers
        config.update({key: getattr(m, flag) for key, flag in LINEAR_KEYS.items()})
        config.update(layer_types=[LINEAR if k else FULL for k in pattern],
                      attention_bias=False, mtp_num_hidden_layers=m.mtp_num_layers or 0)
        if self.moe is not None and not self.moe.dense_layers and \
                "intermediate_size" not in (base or {}):
            config.pop("intermediate_size", None)
        return config


FAMILY = Qwen3NextFamily(
    name="qwen3_next",
    model_types=("qwen3_next",),
    architecture="Qwen3NextForCausalLM",
    defaults=DEFAULTS,
    fixed={"qk_layernorm": True, "attention_output_gate": True},
    known_keys=frozenset({"attention_bias"}),
    checks=require(attention_bias=False),
    moe=MoeKeys(experts=("num_experts",), expert_ffn="moe_intermediate_size",
                shared_ffn="shared_expert_intermediate_size", norm_topk=True),
    mtp=True,  # mtp_num_hidden_layers: its MTP layer under mtp.* (models/mtp.py)
)
