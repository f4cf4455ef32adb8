"""A peft LoRA adapter trained elsewhere on a Hugging Face model (``--adapters``: its
adapter_config.json and adapter_model.safetensors), checked and read into megatron's fused
layers, so that training continues from it.

Hugging Face keeps q, k and v (and gate and up) as separate projections, each with its own
A (r x in) and B (out x r); megatron fuses them into ``linear_qkv`` (and ``linear_fc1``).
One fused adapter of rank r_q + r_k + r_v holds them exactly: A is the A's stacked, and B
places each part's B in that part's rows (megatron's fused row layout, built by
``convert.Layout.to_mcore`` like the base weight's) and in that part's columns of the
rank, zero elsewhere, so B·A gives each projection its own B_p·A_p and nothing across
parts. Each part's own scaling (alpha_p / r_p, or / sqrt(r_p) with rslora; peft's
``rank_pattern``/``alpha_pattern``) is folded into its block of B relative to the fused
layer's scaling, which is the adapter's main scaling: the function is the peft model's.
A part the adapter did not target (k_proj of a q/v adapter) starts as a zero block and
trains with the rest of its fused layer.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..errors import ArgumentError
from ..input_files import check_regular, load_json

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.(model\.layers\.(\d+)\.(self_attn|mlp)\."
                  r"(q|k|v|o|gate|up|down)_proj)\.lora_([AB])\.weight$")
# HF projection -> (megatron layer suffix, the HF parts of that layer in fused order)
_FUSED = {"self_attention.linear_qkv": ("q", "k", "v"), "self_attention.linear_proj": ("o",),
          "mlp.linear_fc1": ("gate", "up"), "mlp.linear_fc2": ("down",)}
_MCORE = {part: suffix for suffix, parts in _FUSED.items() for part in parts}
# adapter_config.json fields whose adapters are not plain LoRA (a true/non-empty value)
_REFUSED = {
    "use_dora": "DoRA (a learned magnitude per output) has no megatron layer here",
    "lora_bias": "LoRA biases on B are not supported",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2 Conv1D layers) is not a supported family",
    "layer_replication": "layer replication changes the model's layers",
    "trainable_token_indices": "trainable tokens are not supported",
    "target_parameters": "LoRA on parameters (MoE experts) is not supported",
    "use_qalora": "QALoRA is not supported",
    "alora_invocation_tokens": "activated LoRA is not supported",
    "modules_to_save": "whole modules saved with the adapter are not imported (train them "
                       "with --modules_to_save instead)",
}


@dataclass(frozen=True)
class Part:
    """One Hugging Face projection of the adapter: its module name, rank and scaling."""

    hf: str          # model.layers.0.self_attn.q_proj
    rank: int
    scaling: float


@dataclass(frozen=True)
class AdapterImport:
    """What resolve read of --adapters: per megatron layer (global name), its targeted
    parts in fused order; and the adapter's main rank/alpha/rslora (the run's flags)."""

    folder: str
    rank: int
    alpha: float
    use_rslora: bool
    dropout: float
    layers: Tuple[Tuple[str, Tuple[Part, ...]], ...]

    def parts(self) -> Dict[str, Tuple[Part, ...]]:
        return dict(self.layers)

    def fused_rank(self, name: str) -> int:
        return sum(p.rank for p in self.parts()[name])

    def scaling(self) -> float:
        """The fused layers' scaling: the adapter's main one."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def fused_alpha(self, name: str) -> float:
        """The alpha that gives a fused layer of its rank the main scaling."""
        rank = self.fused_rank(name)
        return self.scaling() * (math.sqrt(rank) if self.use_rslora else rank)

    def kinds(self) -> List[str]:
        """The megatron layer kinds that hold an adapter (--target_modules' spelling)."""
        kinds = {name.rsplit(".", 1)[1] for name, _ in self.layers}
        return [k for k in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
                if k in kinds]


# ---- resolve's part: the adapter's files checked against the model -------------------------
def read_adapter(flags) -> Optional[AdapterImport]:
    """--adapters with --tuner_type lora: check the folder against --model's shapes and set
    the LoRA flags from its adapter_config.json (a flag given with another value is an
    error). None without --adapters; ArgumentError naming the file and field."""
    t = flags.tuner
    if not t.adapters or t.tuner_type != "lora":
        return None  # the flag checks refuse --adapters without --tuner_type lora
    folder = os.path.abspath(os.path.expanduser(t.adapters))
    where = f"--adapters {t.adapters}"
    if not flags.model.model:
        raise ArgumentError(f"{where}: an imported adapter continues training on the Hugging "
                            f"Face model it was trained on; give that folder as --model")
    config = _read_config(folder, where)
    shapes = _read_shapes(folder, where)
    imported = _layers(config, shapes, flags.model, folder, where)
    rank, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    values = {"lora_rank": rank, "lora_alpha": float(alpha),
              "use_rslora": bool(config.get("use_rslora", False)),
              "target_modules": imported.kinds()}
    conflicts = [f"--{name} {getattr(t, name)!r} (the adapter's {value!r})"
                 for name, value in values.items()
                 if name in flags.explicit and getattr(t, name) != value]
    if t.target_regex is not None:
        conflicts.append(f"--target_regex {t.target_regex!r} (the adapter's tensors decide "
                         f"which layers have adapters)")
    if conflicts:
        raise ArgumentError(f"{where}: {CONFIG} sets the LoRA shape, and these flags "
                            f"disagree with it: {'; '.join(conflicts)}. Drop them.")
    for name, value in values.items():
        setattr(t, name, value)
    t.adapters = folder
    if "lora_dropout" not in flags.explicit:
        t.lora_dropout = imported.dropout
    return imported


def _read_config(folder: str, where: str) -> dict:
    path = os.path.join(folder, CONFIG)
    if not os.path.lexists(path):
        raise ArgumentError(f"{where}: no {CONFIG} in {folder}; expected a folder written by "
                            f"peft's save_pretrained ({CONFIG}, {WEIGHTS})")
    config = load_json(path)  # a regular file only, bounded (input_files)
    if not isinstance(config, dict):
        raise ArgumentError(f"{path} must hold a JSON object")
    if config.get("peft_type") != "LORA":
        raise ArgumentError(f"{path}: peft_type is {config.get('peft_type')!r}; swift-mcore "
                            f"imports LoRA adapters (peft_type 'LORA')")
    for field, why in _REFUSED.items():
        if config.get(field):
            raise ArgumentError(f"{path}: {field} is {config[field]!r}: {why}; swift-mcore "
                                f"imports plain LoRA adapters")
    for field in ("r", "lora_alpha"):
        value = config.get(field, 8)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 \
                or (field == "r" and value != int(value)):
            raise ArgumentError(f"{path}: {field} is {value!r}; expected a positive "
                                f"{'integer' if field == 'r' else 'number'}")
    dropout = config.get("lora_dropout", 0.0)
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ArgumentError(f"{path}: lora_dropout is {dropout!r}; expected a number in [0, 1)")
    return config


def _read_shapes(folder: str, where: str) -> Dict[str, Tuple[int, ...]]:
    from safetensors import safe_open

    path = os.path.join(folder, WEIGHTS)
    if not os.path.lexists(path):
        hint = (" (adapter_model.bin is a pickle swift-mcore does not read: save the adapter "
                "with safe_serialization=True)"
                if os.path.isfile(os.path.join(folder, "adapter_model.bin")) else "")
        raise ArgumentError(f"{where}: no {WEIGHTS} in {folder}{hint}")
    check_regular(path)  # a FIFO would block the reader, a device never end
    try:
        with safe_open(path, framework="pt") as fh:
            slices = {k: fh.get_slice(k) for k in fh.keys()}
            shapes = {k: tuple(v.get_shape()) for k, v in slices.items()}
            dtypes = {k: v.get_dtype() for k, v in slices.items()}
    except Exception as err:  # a truncated or foreign file: safetensors' own message
        raise unreadable_weights(path, err) from None
    for key, dtype in dtypes.items():
        # An integer factor (a quantized adapter, or not a LoRA factor) cast to float would
        # be a different adapter, silently.
        if dtype not in _FLOAT_DTYPES:
            raise ArgumentError(f"{path}: tensor {key} has dtype {dtype}; LoRA factors are "
                                f"floating point ({', '.join(_FLOAT_DTYPES)})")
    return shapes


# safetensors' names of the floating-point dtypes
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def _layers(config: dict, shapes, model, folder: str, where: str) -> AdapterImport:
    """Every tensor mapped to its megatron layer and checked against the model's shapes."""
    from peft.utils.other import get_pattern_key

    from .convert import Layout

    path = os.path.join(folder, WEIGHTS)
    hf_shapes = dict(Layout.from_model_args(model, model.vocab_size or 1).hf_tensors())
    rslora = bool(config.get("use_rslora", False))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, \
        config.get("alpha_pattern") or {}
    found: Dict[str, Dict[str, Tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        match = _KEY.match(key)
        if not match:
            raise ArgumentError(
                f"{path}: tensor {key} is not a LoRA factor of a projection swift-mcore maps "
                f"(q/k/v/o_proj, gate/up/down_proj of model.layers.N; not lm_head, embeddings "
                f"or MoE experts)")
        hf = match.group(1)
        if hf + ".weight" not in hf_shapes:
            raise ArgumentError(f"{path}: tensor {key}: --model {model.model} has no module "
                                f"{hf} ({model.num_layers} layers; an adapter for another "
                                f"model?)")
        found.setdefault(hf, {})[match.group(5)] = shape
    if not found:
        raise ArgumentError(f"{path} holds no LoRA tensor")
    layers: Dict[str, List[Part]] = {}
    for hf in sorted(found, key=_model_order):
        factors = found[hf]
        if set(factors) != {"A", "B"}:
            raise ArgumentError(f"{path}: {hf} has lora_{''.join(factors)} but not both "
                                f"lora_A and lora_B")
        out, inp = hf_shapes[hf + ".weight"]
        rank = factors["A"][0]
        if factors["A"] != (rank, inp) or factors["B"] != (out, rank):
            raise ArgumentError(
                f"{path}: {hf}: lora_A {list(factors['A'])}, lora_B {list(factors['B'])}; "
                f"--model {model.model}'s {hf} is {out} x {inp}, so lora_A must be "
                f"[r, {inp}] and lora_B [{out}, r] (an adapter for another model?)")
        expected = rank_pattern.get(get_pattern_key(rank_pattern.keys(), hf), config.get("r", 8))
        if rank != expected:
            raise ArgumentError(f"{path}: {hf} has rank {rank}, {CONFIG}'s r/rank_pattern say "
                                f"{expected}")
        alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), hf),
                                  config.get("lora_alpha", 8))
        scaling = alpha / (math.sqrt(rank) if rslora else rank)
        i, part = hf.split(".")[2], hf.rsplit(".", 1)[1][: -len("_proj")]
        layers.setdefault(f"decoder.layers.{i}.{_MCORE[part]}", []).append(
            Part(hf=hf, rank=rank, scaling=scaling))
    return AdapterImport(folder=folder, rank=int(config.get("r", 8)),
                         alpha=float(config.get("lora_alpha", 8)), use_rslora=rslora,
                         dropout=float(config.get("lora_dropout", 0.0)),
                         layers=tuple((name, tuple(parts)) for name, parts in layers.items()))


def _model_order(hf: str):
    layer, proj = hf.split(".")[2], hf.rsplit(".", 1)[1][: -len("_proj")]
    order = [p for parts in _FUSED.values() for p in parts]
    return int(layer), order.index(proj)


# ---- the model's part: the fused factors ---------------------------------------------------
def fused_factors(imported: AdapterImport, name: str, tensors, layout, scaling: float,
                  tp_rank: int = 0, tp_size: int = 1):
    """(A, B) of megatron layer ``name`` (global) as this TP rank holds them: A replicated
    and B row-sharded for a column-parallel layer (qkv, fc1), A column-sharded and B
    replicated for a row-parallel one (proj, fc2). ``tensors``: the adapter's, by key;
    ``scaling``: the fused layer's own (each part's B is rescaled to it)."""
    import torch

    parts = imported.parts()[name]
    suffix = name.split(".", 3)[3]
    prefix = parts[0].hf.rsplit(".", 1)[0]  # model.layers.N.self_attn
    total = sum(p.rank for p in parts)
    a = torch.cat([tensors[f"base_model.model.{p.hf}.lora_A.weight"].float() for p in parts])
    by_part = {p.hf.rsplit(".", 1)[1][: -len("_proj")]: p for p in parts}
    hf_shapes = dict(layout.hf_tensors())
    blocks, column = {}, 0
    for proj in _FUSED[suffix]:
        hf = f"{prefix}.{proj}_proj"
        rows = hf_shapes[hf + ".weight"][0]
        block = torch.zeros(rows, total)
        part = by_part.get(proj)
        if part is not None:
            b = tensors[f"base_model.model.{hf}.lora_B.weight"].float()
            ratio = part.scaling / scaling  # 1.0 (exact) when the part has the main scaling
            block[:, column: column + part.rank] = b if ratio == 1.0 else b * ratio
            column += part.rank
        blocks[hf + ".weight"] = block

    def read(source):
        def reader(hf_name, rows=None, cols=None):
            value = source[hf_name]
            value = value[rows] if rows is not None else value
            return value[:, cols] if cols is not None else value
        return reader

    weight = f"{name}.weight"
    if suffix in ("self_attention.linear_qkv", "mlp.linear_fc1"):
        return a, layout.to_mcore(weight, read(blocks), tp_rank, tp_size)
    (hf_weight, b), = blocks.items()
    return layout.to_mcore(weight, read({hf_weight: a}), tp_rank, tp_size), b


def load_tensors(imported: AdapterImport):
    from safetensors.torch import load_file

    path = os.path.join(imported.folder, WEIGHTS)
    check_regular(path)
    try:
        return load_file(path)
    except Exception as err:  # changed since it was checked: one line naming it
        raise unreadable_weights(path, err) from None


def unreadable_weights(path: str, err: Exception) -> ArgumentError:
    """One line for an adapter file the safetensors library could not read."""
    lines = str(err).strip().splitlines()
    reason = f"{type(err).__name__}: {lines[0][:300]}" if lines else type(err).__name__
    return ArgumentError(f"{path} is not a readable safetensors file ({reason})")
