"""gpt-oss (``GptOssForCausalLM``): attention with q/k/v/o biases and a learned sink logit per
head (megatron's learnable softmax offset), sliding-window and full layers in turn, YaRN
RoPE, every layer a mixture of experts whose router and experts have biases and whose
experts apply the clamped SwiGLU (models/gpt_oss_layers.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from ..gpt_oss_layers import QUICK_GELU_ALPHA
from ..mxfp4 import is_mxfp4
from .base import Family, InvalidConfig, MoeKeys, UnsupportedConfig, value_problems
from .gemma3 import GLOBAL, WINDOW, layer_kinds

# transformers' GptOssConfig defaults for keys a config.json may omit
DEFAULTS = {"hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "rope_theta": 150000.0, "tie_word_embeddings": False, "num_experts_per_tok": 4,
            "sliding_window": 128, "swiglu_alpha": QUICK_GELU_ALPHA, "swiglu_limit": 7.0,
            "attention_bias": True, "head_dim": 64}
# GptOssConfig's RoPE when config.json has none
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}
# keys read here and hidden from the common reader (it knows Llama's RoPE and no windows)
OWN_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "sliding_window", "layer_types",
            "swiglu_alpha", "swiglu_limit", "attention_bias")
# flags a gpt-oss model sets that the common export check wants unset
OWN_FLAGS = ("--window_size", "--window_attn_skip_freq", "--activation_func_clamp_value",
             "--rope_type")
FIXED = {"add_bias_linear": True, "add_qkv_bias": True, "swiglu": False,
         "softmax_type": "learnable"}


@dataclass(frozen=True)
class GptOssFamily(Family):
    """Family with gpt-oss's own RoPE, layer kinds and expert activation."""

    def model_values(self, config: Dict[str, Any], model_args: Any) -> Dict[str, Any]:
        invalid = value_problems(config, self.read_keys())
        if invalid:  # before any value is used
            raise InvalidConfig("; ".join(invalid))
        problems: List[str] = []
        quantization = config.get("quantization_config")
        if quantization is not None and not is_mxfp4(config):
            method = quantization.get("quant_method")
            problems.append(f"quantization_config quant_method {method!r} (only 'mxfp4': "
                            f"the Hub's experts, dequantized on load; or a folder of "
                            f"bfloat16 or float32 weights)")
        if config.get("attention_bias") is False:
            problems.append("attention_bias false (megatron's add_bias_linear gives the "
                            "attention output the bias the experts have; only true)")
        alpha = config.get("swiglu_alpha")
        if alpha is not None and float(alpha) != QUICK_GELU_ALPHA:
            problems.append(f"swiglu_alpha {alpha} (megatron's quick_gelu has "
                            f"{QUICK_GELU_ALPHA})")
        limit = config.get("swiglu_limit", DEFAULTS["swiglu_limit"])
        if limit is None or not limit > 0:
            problems.append(f"swiglu_limit {limit!r} (a positive number)")
        kinds, found = ([], [])
        if config.get("num_hidden_layers"):
            kinds, found = layer_kinds(_with_default_kinds(config))
        problems += found
        window = config.get("sliding_window", DEFAULTS["sliding_window"])
        if WINDOW in kinds and not window:
            problems.append(f"sliding_window {window!r} with '{WINDOW}' layers (a window of "
                            f"at least 1 token)")
        rope = _rope(config)
        yarn, found = yarn_values(rope, config, self.defaults)
        problems += found
        core = {k: v for k, v in config.items()
                if k not in OWN_KEYS and k != "quantization_config"}
        theta = rope.get("rope_theta", config.get("rope_theta"))
        core["rope_theta"] = DEFAULTS["rope_theta"] if theta is None else theta
        try:
            values = super().model_values(core, model_args)
        except UnsupportedConfig as err:
            problems.insert(0, str(err))
            values = {}
        if problems:
            raise UnsupportedConfig("; ".join(problems))
        windowed = WINDOW in kinds
        values.update(yarn)
        values.update(
            activation_func_clamp_value=float(limit),
            window_size=int(window) if windowed else None,
            window_attn_skip_freq=("[" + ",".join("1" if k == WINDOW else "0" for k in kinds)
                                   + "]") if windowed else None)
        return values

    def read_keys(self) -> frozenset:
        return super().read_keys() | frozenset(OWN_KEYS)

    def representation_problems(self, m: Any) -> List[str]:
        own = tuple(f"{flag} " for flag in OWN_FLAGS)
        problems = [p for p in super().representation_problems(m) if not p.startswith(own)]
        if m.model_type != self.name:
            # its experts' activation is built for --model_type gpt_oss only
            problems.append(f"--model_type {m.model_type} (a {self.name} model is built with "
                            f"--model_type {self.name})")
        if m.activation_func_clamp_value is None:
            problems.append("--activation_func_clamp_value unset (a gpt_oss model's experts "
                            "clamp: swiglu_limit)")
        if m.window_attn_skip_freq is not None and not m.window_size:
            problems.append("--window_attn_skip_freq without --window_size")
        return problems

    def hf_config(self, m: Any, vocab_size: int, base: Optional[Dict[str, Any]] = None
                  ) -> Dict[str, Any]:
        from ...arguments.model import window_layer_pattern

        # an MXFP4 source is written dequantized (and the older RoPE spelling as 5's)
        base = {k: v for k, v in (base or {}).items()
                if k not in ("rope_scaling", "quantization_config")}
        config = super().hf_config(m, vocab_size, base)
        pattern = window_layer_pattern(m) or [0] * m.num_layers
        rope: Dict[str, Any] = {"rope_type": "default", "rope_theta": float(m.rotary_base)}
        if m.rope_type == "yarn":
            rope.update(rope_type="yarn", factor=m.rotary_scaling_factor,
                        original_max_position_embeddings=m.original_max_position_embeddings,
                        beta_fast=m.beta_fast, beta_slow=m.beta_slow,
                        truncate=m.yarn_truncate)
            if m.mscale_all_dim:
                rope.update(mscale=m.mscale, mscale_all_dim=m.mscale_all_dim)
        config.update(
            rope_parameters=rope, attention_bias=True, swiglu_alpha=QUICK_GELU_ALPHA,
            swiglu_limit=m.activation_func_clamp_value,
            layer_types=[WINDOW if w else GLOBAL for w in pattern],
            sliding_window=m.window_size or (base or {}).get("sliding_window")
            or DEFAULTS["sliding_window"])
        return config


def _with_default_kinds(config: Dict[str, Any]) -> Dict[str, Any]:
    """GptOssConfig's layer kinds when config.json has none: sliding, full, sliding, ..."""
    if config.get("layer_types") is not None:
        return config
    layers = int(config["num_hidden_layers"])
    return {**config, "layer_types": [WINDOW if (i + 1) % 2 else GLOBAL
                                      for i in range(layers)]}


def _rope(config: Dict[str, Any]) -> Dict[str, Any]:
    # transformers reads a given rope_scaling in place of rope_parameters
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(config.get(key), dict) and config[key]:
            return dict(config[key])
    return dict(DEFAULT_ROPE)


def yarn_values(rope: Dict[str, Any], config: Dict[str, Any], defaults: Dict[str, Any]):
    """(ModelArguments values of the RoPE, problems): plain RoPE or YaRN on GPTModel's
    YarnRotaryEmbedding (truncate: its correction_range_round_to_int)."""
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    plain = dict(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0,
                 yarn_truncate=True)
    if any(isinstance(v, dict) for v in rope.values()):
        return plain, ["rope_parameters per layer type (one RoPE for all layers)"]
    if kind == "default":
        return plain, []
    if kind != "yarn":
        return plain, [f"rope_parameters.rope_type {kind!r} (supported: 'default', 'yarn')"]
    problems: List[str] = []
    if rope.get("attention_factor") is not None:
        problems.append("rope_parameters.attention_factor (megatron's YaRN derives it from "
                        "the factor and mscale)")
    if rope.get("partial_rotary_factor") not in (None, 1, 1.0):
        problems.append(f"rope_parameters.partial_rotary_factor "
                        f"{rope['partial_rotary_factor']} (only 1.0)")
    numbers = {k: rope.get(k) for k in ("factor", "original_max_position_embeddings",
                                        "beta_fast", "beta_slow", "mscale", "mscale_all_dim")}
    for name, value in numbers.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value < 0):
            problems.append(f"rope_parameters.{name} {value!r} (a number, at least 0)")
        elif name == "factor" and value == 0:  # transformers' YaRN divides by it
            problems.append("rope_parameters.factor 0 (a number, above 0)")
    original = numbers["original_max_position_embeddings"]
    if not original:
        problems.append("rope_parameters.original_max_position_embeddings is missing for "
                        "rope_type 'yarn'")
    if problems:
        return plain, problems
    factor = numbers["factor"] or (config.get("max_position_embeddings")
                                   or defaults["max_position_embeddings"]) / original
    mscale, all_dim = numbers["mscale"], numbers["mscale_all_dim"]
    both = bool(mscale and all_dim)
    return dict(rope_type="yarn", rotary_scaling_factor=float(factor),
                original_max_position_embeddings=int(original),
                beta_fast=float(numbers["beta_fast"] or 32),
                beta_slow=float(numbers["beta_slow"] or 1),
                mscale=float(mscale) if both else 1.0,
                mscale_all_dim=float(all_dim) if both else 0.0,
                yarn_truncate=rope.get("truncate", True) is not False), []


FAMILY = GptOssFamily(
    name="gpt_oss",
    model_types=("gpt_oss",),
    architecture="GptOssForCausalLM",
    defaults=DEFAULTS,
    fixed=FIXED,
    moe=MoeKeys(experts=("num_local_experts", "num_experts"), expert_ffn="intermediate_size",
                dense_layers=False, norm_topk=None),
)
