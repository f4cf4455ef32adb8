"""What every supported Hugging Face family shares: config.json <-> ModelArguments values.

All four families (Llama, Qwen2, Qwen3, Mistral) are the same decoder: RMSNorm, SwiGLU MLP,
RoPE, grouped-query attention, optional tied embeddings. They differ in a few fixed traits
(bias on q/k/v, a per-head norm on q and k, sliding windows) and in the defaults
transformers assumes for keys a config.json leaves out. A family file states only those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

# megatron-core's Llama-3 RoPE scaling fixes these three (rotary_pos_embedding.py,
# RotaryEmbedding._apply_scaling); only the factor is a parameter.
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

# Keys that change nothing in the function the model computes (ids, bookkeeping, runtime
# options, initialization of fresh weights, dropout during HF training).
IGNORED_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range",
    "attention_dropout", "_name_or_path", "return_dict", "output_attentions",
    "output_hidden_states", "tie_encoder_decoder", "is_encoder_decoder", "id2label",
    "label2id", "problem_type", "tokenizer_class", "prefix", "task_specific_params",
    "chunk_size_feed_forward", "is_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "pruned_heads", "torchscript", "finetuning_task", "decoder_start_token_id", "sep_token_id",
    "embd_pdrop", "resid_pdrop",
})

# Keys every family reads into ModelArguments.
MAPPED_KEYS = frozenset({
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
    "rms_norm_eps", "tie_word_embeddings", "hidden_act", "rope_theta", "rope_scaling",
    "rope_parameters", "partial_rotary_factor",
})

REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "vocab_size")


class UnsupportedConfig(ValueError):
    """A config.json this family cannot represent exactly; the message names the key(s)."""


Check = Callable[[Dict[str, Any], Any], List[str]]


def no_checks(config: Dict[str, Any], model_args: Any) -> List[str]:
    return []


@dataclass(frozen=True)
class Family:
    """One Hugging Face model family.

    name           our name for it (``--model_type``)
    model_types    config.json ``model_type`` values it reads
    architecture   the ``architectures`` entry written on export (and read as a fallback)
    defaults       what transformers assumes for keys config.json may leave out
    fixed          ModelArguments every model of the family has (q/k/v bias, q/k norm)
    known_keys     family keys beyond MAPPED_KEYS that ``checks`` inspects
    checks         family rules: a list of problems (empty: supported)
    """

    name: str
    model_types: Tuple[str, ...]
    architecture: str
    defaults: Dict[str, Any]
    fixed: Dict[str, Any] = field(default_factory=dict)
    known_keys: frozenset = frozenset()
    checks: Check = no_checks

    # ---- config.json -> ModelArguments --------------------------------------------------
    def model_values(self, config: Dict[str, Any], model_args: Any) -> Dict[str, Any]:
        """ModelArguments values for this config.json. Raises UnsupportedConfig naming every
        key it cannot represent exactly."""
        missing = [k for k in REQUIRED_KEYS if config.get(k) is None]
        if missing:
            raise UnsupportedConfig(f"config.json lacks {', '.join(missing)}")
        def get(key: str) -> Any:
            value = config.get(key)
            return self.defaults.get(key) if value is None else value

        problems: List[str] = []
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        if get("hidden_act") != "silu":
            problems.append(f"hidden_act {get('hidden_act')!r} (only 'silu': SwiGLU)")
        if config.get("partial_rotary_factor") not in (None, 1, 1.0):
            problems.append(f"partial_rotary_factor {config['partial_rotary_factor']} "
                            f"(only 1.0)")
        if config.get("quantization_config") is not None:
            problems.append("quantization_config (quantized weights; give the unquantized "
                            "model)")
        theta, scaling, rope_problems = rope_settings(config, self.defaults["rope_theta"])
        problems += rope_problems
        problems += self.checks(config, model_args)
        if problems:
            raise UnsupportedConfig("; ".join(problems))
        values = {
            "model_type": self.name,
            "num_layers": int(config["num_hidden_layers"]),
            "hidden_size": hidden,
            "ffn_hidden_size": int(config["intermediate_size"]),
            "num_attention_heads": heads,
            "num_query_groups": int(get("num_key_value_heads") or heads),
            "kv_channels": int(get("head_dim") or hidden // heads),
            "max_position_embeddings": int(get("max_position_embeddings")),
            "vocab_size": int(config["vocab_size"]),
            "normalization": "RMSNorm",
            "norm_epsilon": float(get("rms_norm_eps")),
            "swiglu": True,
            "position_embedding_type": "rope",
            "rotary_base": theta,
            "rotary_percent": 1.0,
            "untie_embeddings_and_output_weights": not bool(get("tie_word_embeddings")),
            "add_bias_linear": False,
            "add_qkv_bias": False,
            "qk_layernorm": False,
            "use_rope_scaling": scaling is not None,
            "rope_scaling_factor": float(scaling["factor"]) if scaling else 8.0,
        }
        values.update(self.fixed)
        return values

    def unknown_keys(self, config: Dict[str, Any]) -> List[str]:
        known = MAPPED_KEYS | IGNORED_KEYS | self.known_keys | {"quantization_config"}
        return sorted(k for k in config if k not in known)

    # ---- ModelArguments -> config.json --------------------------------------------------
    def representation_problems(self, m: Any) -> List[str]:
        """Flags of ``m`` a config.json of this family cannot express (empty: exportable)."""
        wanted = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
                  "rotary_percent": 1.0, "add_bias_linear": False, "add_qkv_bias": False,
                  "qk_layernorm": False, **self.fixed}
        return [f"--{name} {getattr(m, name)!r} (a {self.name} model has {value!r})"
                for name, value in wanted.items() if getattr(m, name) != value]

    def hf_config(self, m: Any, vocab_size: int, base: Optional[Dict[str, Any]] = None
                  ) -> Dict[str, Any]:
        """config.json values for ModelArguments ``m``. ``base`` (the config.json the model
        came from, when known) keeps the keys swift-mcore does not model (token ids...)."""
        config = {k: v for k, v in (base or {}).items()
                  if k not in ("rope_theta", "rope_scaling", "architectures", "model_type",
                               "transformers_version", "torch_dtype", "dtype")}
        rope: Dict[str, Any] = {"rope_type": "default", "rope_theta": float(m.rotary_base)}
        if m.use_rope_scaling:
            rope.update(rope_type="llama3", factor=float(m.rope_scaling_factor), **LLAMA3_FIXED)
        config.update(
            architectures=[self.architecture],
            hidden_size=m.hidden_size,
            intermediate_size=m.ffn_hidden_size,
            num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_attention_heads,
            num_key_value_heads=m.num_query_groups or m.num_attention_heads,
            head_dim=m.kv_channels or m.hidden_size // m.num_attention_heads,
            max_position_embeddings=m.max_position_embeddings,
            vocab_size=vocab_size,
            rms_norm_eps=m.norm_epsilon,
            hidden_act="silu",
            tie_word_embeddings=not m.untie_embeddings_and_output_weights,
            rope_parameters=rope,
        )
        return config


def rope_settings(config: Dict[str, Any], default_theta: float
                  ) -> Tuple[int, Optional[Dict[str, Any]], List[str]]:
    """(RoPE base, Llama-3 scaling parameters or None, problems), from either spelling:
    transformers 5's ``rope_parameters`` or the older ``rope_theta`` + ``rope_scaling``."""
    params = config.get("rope_parameters")
    problems: List[str] = []
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        return 0, None, ["rope_parameters per layer type (only one RoPE for all layers)"]
    if isinstance(params, dict):
        theta = params.get("rope_theta", config.get("rope_theta", default_theta))
        scaling = dict(params)
        key = "rope_parameters"
    else:
        theta = config.get("rope_theta", default_theta)
        scaling = dict(config.get("rope_scaling") or {})
        key = "rope_scaling"
    if theta is None:
        theta = default_theta
    if float(theta) != math.floor(float(theta)):
        problems.append(f"rope_theta {theta} (megatron's rotary_base is an integer)")
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type == "default":
        return int(float(theta)), None, problems
    if rope_type != "llama3":
        problems.append(f"{key}.rope_type {rope_type!r} (supported: 'default', 'llama3')")
        return int(float(theta)), None, problems
    for name, value in LLAMA3_FIXED.items():
        if scaling.get(name) is not None and float(scaling[name]) != value:
            problems.append(f"{key}.{name} {scaling[name]} (megatron-core's Llama-3 scaling "
                            f"uses {value:g})")
    if scaling.get("factor") is None:
        problems.append(f"{key}.factor is missing for rope_type 'llama3'")
    return int(float(theta)), scaling, problems


def sliding_window_check(window_key: str, enabled_key: Optional[str] = None) -> Check:
    """A sliding window is exact only when it covers the whole training sequence (megatron's
    local attention has none)."""

    def check(config: Dict[str, Any], model_args: Any) -> List[str]:
        window = config.get(window_key)
        if enabled_key is not None and not config.get(enabled_key):
            return []
        if window is None or model_args is None or window >= model_args.seq_length:
            return []
        return [f"{window_key} {window} is shorter than --seq_length {model_args.seq_length} "
                f"(swift-mcore attends over the whole sequence; lower --seq_length to "
                f"{window} or less)"]

    return check


def require(**expected: Any) -> Check:
    """Keys that must hold one value (or be absent) for the model to be representable."""

    def check(config: Dict[str, Any], model_args: Any) -> List[str]:
        return [f"{key} {config[key]!r} (only {value!r})" for key, value in expected.items()
                if config.get(key) is not None and config[key] != value]

    return check


def all_of(*checks: Check) -> Check:
    def check(config: Dict[str, Any], model_args: Any) -> List[str]:
        return [problem for c in checks for problem in c(config, model_args)]

    return check
