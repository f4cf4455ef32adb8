"""Gemma 3 text (``Gemma3ForCausalLM``, model_type gemma3_text): sliding-window and global
layers with their own RoPE bases, four zero-centred norms per layer, q/k norms, the scaled
embedding, a gated gelu-tanh MLP and query_pre_attn_scalar (models/gemma3_layers.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from .base import UNSET_FLAGS, InvalidConfig, UnsupportedConfig, require, value_problems
from .text_model import TextModelFamily

WINDOW, GLOBAL = "sliding_attention", "full_attention"
# keys read here and hidden from the common reader (it knows Llama's spelling)
OWN_KEYS = ("hidden_activation", "hidden_act", "query_pre_attn_scalar", "sliding_window",
            "layer_types", "sliding_window_pattern", "_sliding_window_pattern",
            "rope_local_base_freq", "attn_logit_softcapping", "final_logit_softcapping",
            "use_bidirectional_attention", "rope_parameters", "rope_scaling", "rope_theta")
# transformers' Gemma3TextConfig defaults for keys a config.json may omit
DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
            "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
            "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
            "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
            "head_dim": 256,
            "sliding_window_pattern": 6, "hidden_act": "silu"}


def layer_kinds(config: Dict[str, Any]) -> Tuple[List[str], List[str]]:
    """Each layer's kind (sliding_attention / full_attention) and the problems found:
    from layer_types, else from the sliding-window pattern (every k-th layer global)."""
    layers = int(config["num_hidden_layers"])
    kinds = config.get("layer_types")
    if kinds is not None:
        bad = sorted({k for k in kinds if k not in (WINDOW, GLOBAL)})
        if bad or len(kinds) != layers:
            return [], [f"layer_types {kinds!r} ({layers} entries of '{WINDOW}' or "
                        f"'{GLOBAL}')"]
        return list(kinds), []
    # transformers reads sliding_window_pattern only: _sliding_window_pattern (its attribute's
    # name) in a config.json does not set the layers
    every = config.get("sliding_window_pattern") or DEFAULTS["sliding_window_pattern"]
    return [GLOBAL if (i + 1) % int(every) == 0 else WINDOW for i in range(layers)], []


def rope_bases(config: Dict[str, Any]) -> Tuple[Dict[str, float], List[str]]:
    """The RoPE base of each layer kind, from transformers 5's per-kind rope_parameters or
    the older rope_theta + rope_local_base_freq (+ rope_scaling: the global layers')."""
    params = config.get("rope_parameters")
    problems: List[str] = []
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        per_kind = {kind: dict(params.get(kind) or {}) for kind in (WINDOW, GLOBAL)}
        names = {kind: f"rope_parameters.{kind}" for kind in per_kind}
        # as transformers' Gemma3TextConfig: rope_scaling updates the full_attention layers'
        # RoPE, and the top-level bases fill a kind that gives none
        if isinstance(config.get("rope_scaling"), dict) and config["rope_scaling"]:
            per_kind[GLOBAL].update(config["rope_scaling"])
            names[GLOBAL] = "rope_scaling (over rope_parameters.full_attention)"
        for kind, key in ((GLOBAL, "rope_theta"), (WINDOW, "rope_local_base_freq")):
            if per_kind[kind].get("rope_theta") is None:
                per_kind[kind]["rope_theta"] = config.get(key)
    else:
        per_kind = {WINDOW: {"rope_theta": config.get("rope_local_base_freq")},
                    GLOBAL: {**dict(params or config.get("rope_scaling") or {}),
                             "rope_theta": (params or {}).get("rope_theta",
                                                              config.get("rope_theta"))}}
        names = {WINDOW: "rope_local_base_freq", GLOBAL: "rope_parameters" if params else
                 "rope_scaling"}
    fallback = {WINDOW: DEFAULTS["rope_local_base_freq"], GLOBAL: DEFAULTS["rope_theta"]}
    bases: Dict[str, Any] = {}
    for kind, rope in per_kind.items():
        theta = rope.get("rope_theta")
        theta = fallback[kind] if theta is None else theta
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        factor = rope.get("factor")
        if kind == GLOBAL and rope_type == "linear":
            # positions divided by the factor: megatron's seq_len_interpolation_factor
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) \
                    or not math.isfinite(factor) or factor <= 0:
                problems.append(f"{names[kind]}.factor {factor!r} (a positive number for "
                                f"rope_type 'linear')")
            else:
                bases["factor"] = float(factor)
        elif rope_type != "default":
            problems.append(f"{names[kind]}.rope_type {rope_type!r} (supported: 'default', "
                            f"and 'linear' on the full_attention layers)")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) \
                or not math.isfinite(theta) or theta <= 0:
            problems.append(f"{names[kind]} rope_theta {theta!r} (a positive number)")
        elif float(theta) != math.floor(float(theta)):
            problems.append(f"{names[kind]} rope_theta {theta} (megatron's RoPE base is an "
                            f"integer)")
        else:
            bases[kind] = int(float(theta))
    return bases, problems


@dataclass(frozen=True)
class Gemma3Family(TextModelFamily):
    """Family with Gemma 3's own reading and writing of config.json."""

    own_keys = OWN_KEYS

    def text_model_values(self, config: Dict[str, Any], model_args: Any) -> Dict[str, Any]:
        if config.get("model_type") == "gemma3" or "text_config" in config:
            raise UnsupportedConfig(
                f"model_type {config.get('model_type')!r} (Gemma 3's vision-language model, "
                f"its text model under text_config) is not supported yet; give a folder of "
                f"the text model alone (model_type 'gemma3_text', Gemma3ForCausalLM)")
        # its own keys' values too (the common reader checks only the keys it reads)
        invalid = value_problems(config, self.read_keys())
        if invalid:
            raise InvalidConfig("; ".join(invalid))
        problems: List[str] = []
        act = config.get("hidden_activation") or DEFAULTS["hidden_activation"]
        if act != "gelu_pytorch_tanh":
            problems.append(f"hidden_activation {act!r} (only 'gelu_pytorch_tanh')")
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if config.get(key) is not None:
                problems.append(f"{key} {config[key]} (logit soft-capping is not supported; "
                                f"only null)")
        if config.get("use_bidirectional_attention"):
            problems.append("use_bidirectional_attention true (only causal attention)")
        kinds, found = layer_kinds(config) if config.get("num_hidden_layers") else ([], [])
        problems += found
        bases, found = rope_bases(config)
        problems += found
        window = config.get("sliding_window", DEFAULTS["sliding_window"])
        if WINDOW in kinds and not window:
            problems.append(f"sliding_window {window!r} with '{WINDOW}' layers (a window of "
                            f"at least 1 token)")
        # the common keys through the common reader (it checks every value's type first)
        core = {k: v for k, v in config.items() if k not in OWN_KEYS}
        core["rope_theta"] = bases.get(GLOBAL, DEFAULTS["rope_theta"])
        values = self.common_values(core, model_args, problems)
        scalar = config.get("query_pre_attn_scalar") or DEFAULTS["query_pre_attn_scalar"]
        windowed = WINDOW in kinds
        values.update(
            softmax_scale=float(scalar) ** -0.5,
            window_size=int(window) if windowed else None,
            window_attn_skip_freq=("[" + ",".join("1" if k == WINDOW else "0" for k in kinds)
                                   + "]") if windowed else None,
            rotary_base_local=bases[WINDOW] if windowed else None,
            rotary_seq_len_interpolation_factor=bases.get("factor"),
        )
        return values

    def representation_problems(self, m: Any) -> List[str]:
        # the window, its pattern, the local RoPE base and the score scale are Gemma 3's
        own = tuple(f"--{name} " for name in UNSET_FLAGS)
        problems = [p for p in super().representation_problems(m) if not p.startswith(own)]
        if m.model_type != self.name:
            # its layers (norms, embedding scale, MLP) are built for --model_type gemma3 only
            problems.append(f"--model_type {m.model_type} (a {self.name} model is built with "
                            f"--model_type {self.name})")
        if m.window_attn_skip_freq is not None and not m.window_size:
            problems.append("--window_attn_skip_freq without --window_size")
        if m.softmax_scale is not None and _scalar(m) is None:
            problems.append(f"--softmax_scale {m.softmax_scale} (a {self.name} config.json "
                            f"holds query_pre_attn_scalar, an integer, as softmax_scale ** -2: "
                            f"here {m.softmax_scale ** -2:g})")
        return problems

    def hf_config(self, m: Any, vocab_size: int, base: Optional[Dict[str, Any]] = None
                  ) -> Dict[str, Any]:
        from ...arguments.model import window_layer_pattern

        base = {k: v for k, v in (base or {}).items()
                if k not in ("rope_local_base_freq", "sliding_window_pattern",
                             "_sliding_window_pattern", "hidden_act", "rope_parameters")}
        config = super().hf_config(m, vocab_size, base)
        config.pop("hidden_act", None)
        scalar = _scalar(m)
        pattern = window_layer_pattern(m) or [0] * m.num_layers
        config.update(
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=scalar,
            sliding_window=m.window_size or (base or {}).get("sliding_window") or
            DEFAULTS["sliding_window"],
            layer_types=[WINDOW if w else GLOBAL for w in pattern],
            rope_parameters={
                WINDOW: {"rope_type": "default",
                         "rope_theta": float(m.rotary_base_local or m.rotary_base)},
                GLOBAL: {"rope_type": "default", "rope_theta": float(m.rotary_base)}
                if m.rotary_seq_len_interpolation_factor is None else
                {"rope_type": "linear", "rope_theta": float(m.rotary_base),
                 "factor": float(m.rotary_seq_len_interpolation_factor)}},
        )
        return config


def _scalar(m: Any) -> Optional[int]:
    """query_pre_attn_scalar of ModelArguments ``m`` (168 ** -0.5 back to 168); None when
    softmax_scale ** -2 is no integer (transformers' Gemma3TextConfig takes only one)."""
    if m.softmax_scale is None:
        return m.kv_channels or m.hidden_size // m.num_attention_heads
    scalar = 1.0 / m.softmax_scale ** 2
    return int(round(scalar)) if round(scalar) >= 1 and \
        abs(scalar - round(scalar)) < 1e-6 * scalar else None


FAMILY = Gemma3Family(
    name="gemma3",
    # the multimodal folder's type: its language model trains alone (models/text_part.py)
    model_types=("gemma3_text", "gemma3"),
    architecture="Gemma3ForCausalLM",
    defaults=DEFAULTS,
    # the gated MLP is gelu-tanh, not SwiGLU (models/gemma3_layers.py builds it)
    fixed={"qk_layernorm": True, "swiglu": False},
    known_keys=frozenset({"attention_bias"}),
    checks=require(attention_bias=False),
)
