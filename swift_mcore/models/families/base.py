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


class InvalidConfig(UnsupportedConfig):
    """A config.json value no model has (a string for a number, a size of 0, a dtype that is
    not floating point); the message names the key(s)."""


@dataclass(frozen=True)
class Value:
    """What one config.json key accepts; null (or absent) means the family's default.

    kind    int | number | bool | str | dtype | dict | int_list | str_list
    low     the smallest number accepted (ints: inclusive; numbers: > low when low_open)
    high    the largest number accepted (inclusive)
    """

    kind: str
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False

    def problem(self, key: str, value: Any) -> Optional[str]:
        if value is None:
            return None
        if isinstance(value, str) and self.kind in ("int", "number", "int_list"):
            return f"{key} {value!r} is a string (write the number without quotes)"
        if self.kind == "int":
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not float(value).is_integer():
                return f"{key} {value!r} (an integer)"
            return self._range(key, value)
        if self.kind == "number":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return f"{key} {value!r} (a number)"
            return None if value != value else self._range(key, value)  # nan: the flag's check
        if self.kind == "bool":
            return None if isinstance(value, bool) else f"{key} {value!r} (true or false)"
        if self.kind == "str":
            return None if isinstance(value, str) else f"{key} {value!r} (a string)"
        if self.kind == "dtype":
            return None if value in FLOAT_DTYPES else (
                f"{key} {value!r} (the weights' floating-point type: "
                f"{', '.join(sorted(FLOAT_DTYPES))}; quantized models are not supported)")
        if self.kind == "dict":
            return None if isinstance(value, dict) else f"{key} {value!r} (an object)"
        if self.kind in ("int_list", "str_list"):
            item = int if self.kind == "int_list" else str
            if not isinstance(value, list) or any(
                    isinstance(v, bool) or not isinstance(v, item) for v in value):
                return f"{key} {value!r} (a list of {'integers' if item is int else 'strings'})"
            for v in value if item is int else ():
                problem = self._range(f"{key} item", v)
                if problem:
                    return problem
        return None

    def _range(self, key: str, value: float) -> Optional[str]:
        low, high = self.low, self.high
        below = low is not None and (value <= low if self.low_open else value < low)
        if below or (high is not None and value > high):
            if low is not None and high is not None:
                return f"{key} {value!r} (from {_num(low)} to {_num(high)})"
            if low is not None:
                return f"{key} {value!r} ({'above' if self.low_open else 'at least'} " \
                       f"{_num(low)})"
            return f"{key} {value!r} (at most {_num(high)})"
        return None


def _num(value: float) -> str:
    return f"{int(value):,}".replace(",", "_") if float(value).is_integer() else str(value)


FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})
# Every key any family reads, with what it accepts (null: the family default). A key a
# family reads must be here: tests/models/test_families.py checks it.
VALUES: Dict[str, Value] = {
    "hidden_size": Value("int", 1), "intermediate_size": Value("int", 1),
    "num_hidden_layers": Value("int", 1),  # the upper bound: --num_layers' (MAX_LAYERS)
    "num_attention_heads": Value("int", 1), "num_key_value_heads": Value("int", 1),
    "head_dim": Value("int", 1), "max_position_embeddings": Value("int", 1),
    "vocab_size": Value("int", 1), "rms_norm_eps": Value("number"),
    "tie_word_embeddings": Value("bool"), "hidden_act": Value("str"),
    "rope_theta": Value("number", 0, low_open=True), "rope_scaling": Value("dict"),
    "rope_parameters": Value("dict"), "partial_rotary_factor": Value("number"),
    "torch_dtype": Value("dtype"), "dtype": Value("dtype"),
    "quantization_config": Value("dict"),
    # family traits
    "attention_bias": Value("bool"), "qkv_bias": Value("bool"), "mlp_bias": Value("bool"),
    "pretraining_tp": Value("int", 1),
    "use_sliding_window": Value("bool"), "sliding_window": Value("int", 0),
    "max_window_layers": Value("int", 0), "layer_types": Value("str_list"),
    # mixture of experts
    "num_experts": Value("int", 0), "num_local_experts": Value("int", 0),
    "moe_intermediate_size": Value("int", 1), "shared_expert_intermediate_size": Value("int", 1),
    "num_experts_per_tok": Value("int", 1), "router_aux_loss_coef": Value("number", 0),
    "output_router_logits": Value("bool"), "norm_topk_prob": Value("bool"),
    "router_jitter_noise": Value("number", 0), "decoder_sparse_step": Value("int", 1),
    "mlp_only_layers": Value("int_list", 0),
    # multi-latent attention and sigmoid group-limited routing (DeepSeek-V3)
    "q_lora_rank": Value("int", 1), "kv_lora_rank": Value("int", 1),
    "qk_nope_head_dim": Value("int", 1), "qk_rope_head_dim": Value("int", 2),
    "qk_head_dim": Value("int", 1), "v_head_dim": Value("int", 1),
    "rope_interleave": Value("bool"), "n_routed_experts": Value("int", 1),
    "n_shared_experts": Value("int", 0), "routed_scaling_factor": Value("number", 0,
                                                                       low_open=True),
    "n_group": Value("int", 1), "topk_group": Value("int", 1),
    "first_k_dense_replace": Value("int", 0), "num_nextn_predict_layers": Value("int", 0),
    "moe_layer_freq": Value("int", 1), "scoring_func": Value("str"), "topk_method": Value("str"),
    "ep_size": Value("int", 1), "seq_aux": Value("bool"), "aux_loss_alpha": Value("number", 0),
    "use_qk_norm": Value("bool"),
    # Gemma 3
    "hidden_activation": Value("str"), "query_pre_attn_scalar": Value("int", 1),
    "rope_local_base_freq": Value("number", 0, low_open=True),
    "sliding_window_pattern": Value("int", 1), "_sliding_window_pattern": Value("int", 1),
    "attn_logit_softcapping": Value("number"), "final_logit_softcapping": Value("number"),
    "use_bidirectional_attention": Value("bool"),
    # gpt-oss
    "swiglu_alpha": Value("number", 0, low_open=True),
    "swiglu_limit": Value("number", 0, low_open=True),
    # Qwen3-Next (gated delta-net layers)
    "full_attention_interval": Value("int", 1), "linear_conv_kernel_dim": Value("int", 1),
    "linear_key_head_dim": Value("int", 1), "linear_value_head_dim": Value("int", 1),
    "linear_num_key_heads": Value("int", 1), "linear_num_value_heads": Value("int", 1),
    "mtp_num_hidden_layers": Value("int", 0), "mtp_use_dedicated_embeddings": Value("bool"),
    # vision-language (Qwen2.5-VL: models/vision.py)
    "text_config": Value("dict"), "vision_config": Value("dict"),
    "image_token_id": Value("int", 0), "video_token_id": Value("int", 0),
    "vision_start_token_id": Value("int", 0), "vision_end_token_id": Value("int", 0),
}
# Flags only some families express (a family that does lists them in its ``fixed`` or
# handles them in its own representation_problems); every other family needs them unset.
UNSET_FLAGS = ("window_size", "window_attn_skip_freq", "rotary_base_local", "softmax_scale",
               "rotary_seq_len_interpolation_factor")


def value_problems(config: Dict[str, Any], keys) -> List[str]:
    """Every key of ``keys`` in ``config`` whose value its VALUES entry refuses."""
    from ...arguments.model import MAX_LAYERS

    problems = [VALUES[k].problem(k, config.get(k)) for k in sorted(keys) if k in config]
    layers = config.get("num_hidden_layers")
    if isinstance(layers, (int, float)) and not isinstance(layers, bool) and layers > MAX_LAYERS:
        problems.append(f"num_hidden_layers {layers} (at most {MAX_LAYERS:_})")
    return [p for p in problems if p]


def canonical_config(family: "Family", config: Dict[str, Any]) -> Dict[str, Any]:
    """``config`` with each other name transformers' config class gives a key (its
    attribute_map: num_local_experts for DeepSeek-V3's n_routed_experts, num_experts for
    gpt-oss's num_local_experts) read as the name the family reads. InvalidConfig when a
    config.json gives both names different values (transformers keeps whichever it sets
    last)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    kind = family.model_types[0]
    aliases = getattr(CONFIG_MAPPING[kind], "attribute_map", {}) \
        if kind in CONFIG_MAPPING else {}
    read, out, problems = family.read_keys(), dict(config), []
    for alias, key in aliases.items():
        if config.get(alias) is None:
            continue
        if config.get(key) is not None and config[key] != config[alias]:
            problems.append(f"{alias} {config[alias]!r} and {key} {config[key]!r} (two names "
                            f"of one value in transformers' {kind} config)")
        elif alias not in read and key in read:
            out[key] = out.pop(alias)
    if problems:
        raise InvalidConfig("; ".join(problems))
    return out


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
    mtp            whether its folders may hold multi-token prediction layers
    """

    name: str
    model_types: Tuple[str, ...]
    architecture: str
    defaults: Dict[str, Any]
    fixed: Dict[str, Any] = field(default_factory=dict)
    known_keys: frozenset = frozenset()
    checks: Check = no_checks
    moe: Optional["MoeKeys"] = None  # a mixture-of-experts family: its config.json keys
    mtp: bool = False  # its folders may carry multi-token prediction layers (models/mtp.py)

    # ---- config.json -> ModelArguments --------------------------------------------------
    def model_values(self, config: Dict[str, Any], model_args: Any) -> Dict[str, Any]:
        """ModelArguments values for this config.json. Raises UnsupportedConfig naming every
        key it cannot represent exactly."""
        missing = [k for k in REQUIRED_KEYS if config.get(k) is None]
        if missing:
            raise UnsupportedConfig(f"config.json lacks {', '.join(missing)}")
        invalid = value_problems(config, self.read_keys())
        if invalid:
            raise InvalidConfig("; ".join(invalid))
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
        moe_values = {}
        if self.moe is not None:
            moe_values, moe_problems = self.moe.model_values(config, get)
            problems += moe_problems
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
        values.update(moe_values)
        from ..value_head import config_num_labels, is_score_config

        if is_score_config(config):  # a reward model's folder: its score head, not an LM head
            labels = config_num_labels(config)
            if labels != 1:
                raise UnsupportedConfig(f"architectures {config['architectures'][0]} with "
                                        f"{labels} labels (id2label): only 1, a reward "
                                        f"model's score")
            values["num_labels"] = 1
        return values

    def read_keys(self) -> frozenset:
        """The keys this family reads (each checked against VALUES)."""
        keys = MAPPED_KEYS | self.known_keys | {"quantization_config", "torch_dtype", "dtype"}
        return keys | self.moe.keys() if self.moe is not None else keys

    def unknown_keys(self, config: Dict[str, Any]) -> List[str]:
        known = IGNORED_KEYS | self.read_keys()
        return sorted(k for k in config if k not in known)

    # ---- ModelArguments -> config.json --------------------------------------------------
    def representation_problems(self, m: Any) -> List[str]:
        """Flags of ``m`` a config.json of this family cannot express (empty: exportable)."""
        wanted = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
                  "rotary_percent": 1.0, "add_bias_linear": False, "add_qkv_bias": False,
                  "qk_layernorm": False, "multi_latent_attention": False,
                  "softmax_type": "vanilla", "activation_func_clamp_value": None,
                  "linear_attention_freq": None, "attention_output_gate": False,
                  **{name: None for name in UNSET_FLAGS}, **self.fixed}
        problems = [f"--{name} {getattr(m, name)!r} (a {self.name} model has {value!r})"
                    for name, value in wanted.items() if getattr(m, name) != value]
        if m.mtp_num_layers and not self.mtp:
            problems.append(f"--mtp_num_layers {m.mtp_num_layers} (a {self.name} folder holds "
                            f"no multi-token prediction layers)")
        if self.moe is None and getattr(m, "num_experts", None) is not None:
            problems.append(f"--num_experts {m.num_experts} (a {self.name} model is dense)")
        elif self.moe is not None:
            problems += self.moe.representation_problems(m, self.name)
        if m.rope_type != "rope" and not m.multi_latent_attention:
            problems.append(f"--rope_type {m.rope_type} (a {self.name} model has plain RoPE)")
        return problems

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
        if self.moe is not None:
            config.update(self.moe.hf_config(m))
        if getattr(m, "num_labels", None):  # a reward model: *ForSequenceClassification
            from ..value_head import SEQUENCE_CLASSIFICATION

            for key in ("id2label", "label2id", "num_labels"):
                config.pop(key, None)
            config.update(architectures=[self.architecture.replace(
                "ForCausalLM", SEQUENCE_CLASSIFICATION)], num_labels=m.num_labels)
        return config


def rope_settings(config: Dict[str, Any], default_theta: float
                  ) -> Tuple[int, Optional[Dict[str, Any]], List[str]]:
    """(RoPE base, Llama-3 scaling parameters or None, problems), from either spelling:
    transformers 5's ``rope_parameters`` or the older ``rope_theta`` + ``rope_scaling``."""
    params = config.get("rope_parameters")
    problems: List[str] = []
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        return 0, None, ["rope_parameters per layer type (only one RoPE for all layers)"]
    # transformers reads rope_scaling, when given, in place of rope_parameters
    # (convert_rope_params_to_dict: ``rope_scaling or rope_parameters``)
    if isinstance(params, dict) and not config.get("rope_scaling"):
        theta = params.get("rope_theta", config.get("rope_theta", default_theta))
        scaling = dict(params)
        key = "rope_parameters"
    else:
        scaling = dict(config.get("rope_scaling") or {})
        theta = scaling.get("rope_theta", config.get("rope_theta", default_theta))
        key = "rope_scaling"
    if theta is None:
        theta = default_theta
    numbers = {"rope_theta": theta, **{k: scaling.get(k) for k in ("factor", *LLAMA3_FIXED)}}
    for name, value in numbers.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            return 0, None, [f"{key}.{name} {value!r} (a positive number)"]
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


# The router of the softmax MoE families; sigmoid_moe.py's families set these from config.json.
SOFTMAX_ROUTER = {"moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False,
                  "moe_router_num_groups": None, "moe_router_topk_scaling_factor": None}


@dataclass(frozen=True)
class MoeKeys:
    """How a mixture-of-experts family spells its experts in config.json.

    experts          key(s) of the routed expert count (the first is written)
    expert_ffn       key of a routed expert's inner size (intermediate_size: Mixtral's)
    shared_ffn       key of the gated shared expert's size (Qwen2-MoE), or None
    dense_layers     whether decoder_sparse_step / mlp_only_layers choose dense layers
    norm_topk        the norm_topk_prob key's value when absent, or None: always normalised
    softmax_router   megatron's plain softmax router (SOFTMAX_ROUTER), refusing the sigmoid
                     router's flags on export
    """

    experts: Tuple[str, ...]
    expert_ffn: str
    shared_ffn: Optional[str] = None
    dense_layers: bool = True
    norm_topk: Optional[bool] = False
    softmax_router: bool = True  # False: sigmoid_moe.py's router (its family checks it)

    def keys(self) -> frozenset:
        keys = {*self.experts, self.expert_ffn, "num_experts_per_tok", "router_aux_loss_coef",
                "output_router_logits", "norm_topk_prob", "router_jitter_noise"}
        if self.shared_ffn:
            keys.add(self.shared_ffn)
        if self.dense_layers:
            keys |= {"decoder_sparse_step", "mlp_only_layers"}
        return frozenset(keys)

    def model_values(self, config: Dict[str, Any], get) -> Tuple[Dict[str, Any], List[str]]:
        problems: List[str] = []
        count = next((config[k] for k in self.experts if config.get(k) is not None), None)
        if not count:
            return {}, [f"{self.experts[0]} is missing or 0 (a dense model: use the dense "
                        f"family)"]
        layers = int(config["num_hidden_layers"])
        pattern = [1] * layers
        if self.dense_layers:
            step = int(config.get("decoder_sparse_step") or 1)
            dense = set(config.get("mlp_only_layers") or [])
            pattern = [0 if i in dense or (i + 1) % step else 1 for i in range(layers)]
        if config.get("router_jitter_noise"):
            problems.append(f"router_jitter_noise {config['router_jitter_noise']} (megatron's "
                            f"router has no multiplicative jitter; only 0)")
        topk = int(get("num_experts_per_tok") or 0)
        if not 1 <= topk <= int(count):
            problems.append(f"num_experts_per_tok {topk} (1 to {self.experts[0]} {count})")
        shared = int(get(self.shared_ffn) or 0) if self.shared_ffn else 0
        norm = True if self.norm_topk is None else bool(config.get("norm_topk_prob",
                                                                   self.norm_topk))
        if topk == 1 and norm:
            # renormalised over one expert, its weight is always 1: the LM loss gives the
            # router no gradient, and megatron-core refuses to train such a router
            problems.append(
                "num_experts_per_tok 1 with " + ("norm_topk_prob true" if self.norm_topk
                                                 is not None else "a router that always "
                                                 "renormalises")
                + " (the one expert's weight is always 1, so the router would learn nothing "
                  "from the loss; megatron-core trains top-1 routing only as Switch "
                  "Transformers do, softmax before the choice: norm_topk_prob false)")
        values = {
            "num_experts": int(count),
            "moe_router_topk": topk,
            "moe_ffn_hidden_size": int(get(self.expert_ffn)),
            "moe_shared_expert_intermediate_size": shared or None,
            "moe_shared_expert_gate": bool(shared),
            "moe_layer_freq": "[" + ",".join(map(str, pattern)) + "]",
            # top-k of the softmax, not renormalised (norm_topk_prob false) = softmax before
            # top-k; renormalised = softmax over the k largest logits (megatron's default)
            "moe_router_pre_softmax": not norm,
            "moe_aux_loss_coeff": float(config.get("router_aux_loss_coef") or 0.0),
        }
        return values, problems

    def representation_problems(self, m: Any, family: str) -> List[str]:
        if getattr(m, "num_experts", None) is None:
            return [f"--num_experts unset (a {family} model is a mixture of experts)"]
        from ...arguments.model import moe_layer_pattern

        problems = []
        if not self.dense_layers and 0 in moe_layer_pattern(m):
            problems.append(f"--moe_layer_freq {m.moe_layer_freq} (every {family} layer is "
                            f"MoE)")
        shared = m.moe_shared_expert_intermediate_size
        if self.shared_ffn is None and shared:
            problems.append(f"--moe_shared_expert_intermediate_size {shared} (a {family} "
                            f"model has no shared expert)")
        if self.shared_ffn and bool(shared) != bool(m.moe_shared_expert_gate):
            problems.append(f"--moe_shared_expert_gate {m.moe_shared_expert_gate} (a {family} "
                            f"shared expert is gated)")
        if self.norm_topk is None and m.moe_router_pre_softmax:
            problems.append(f"--moe_router_pre_softmax (a {family} router renormalises its "
                            f"top-k weights)")
        if self.expert_ffn == "intermediate_size" and m.moe_ffn_hidden_size not in (
                None, m.ffn_hidden_size):
            problems.append(f"--moe_ffn_hidden_size {m.moe_ffn_hidden_size} differs from "
                            f"--ffn_hidden_size {m.ffn_hidden_size} (a {family} config has one "
                            f"intermediate_size)")
        if self.softmax_router:
            problems += [f"--{flag} {getattr(m, flag)!r} (a {family} router has {value!r})"
                         for flag, value in SOFTMAX_ROUTER.items() if getattr(m, flag) != value]
        # aux_loss, seq_aux_loss and global_aux_loss only add a training loss: the forward
        # transformers computes is the same, and router_aux_loss_coef keeps the coefficient.
        # Sinkhorn routes by another rule while training.
        if m.moe_router_load_balancing_type == "sinkhorn":
            problems.append(f"--moe_router_load_balancing_type sinkhorn (a {family} router "
                            f"chooses its experts by the top-k router logits)")
        return problems

    def hf_config(self, m: Any) -> Dict[str, Any]:
        from ...arguments.model import moe_layer_pattern

        config: Dict[str, Any] = {
            self.experts[0]: m.num_experts,
            "num_experts_per_tok": m.moe_router_topk,
            self.expert_ffn: m.moe_ffn_hidden_size or m.ffn_hidden_size,
            "router_aux_loss_coef": m.moe_aux_loss_coeff,
        }
        if self.norm_topk is not None:
            config["norm_topk_prob"] = not m.moe_router_pre_softmax
        if self.shared_ffn:
            config[self.shared_ffn] = m.moe_shared_expert_intermediate_size or 0
        if self.dense_layers:
            pattern = moe_layer_pattern(m)
            config.update(decoder_sparse_step=1,
                          mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe])
        return config
