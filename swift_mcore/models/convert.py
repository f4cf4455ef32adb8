"""The weight layout mapping between Hugging Face (Llama-style names) and megatron-core GPTModel,
in both directions, one tensor at a time.

megatron keeps q, k and v in one ``linear_qkv`` whose rows are grouped per query group:
for each key/value head, its ``heads / groups`` query heads, then its key head, then its
value head. Plain concatenation [q; k; v] gives wrong logits. ``linear_fc1`` is [gate; up].
Tensor parallelism shards column-parallel layers (qkv, fc1, embedding, output) by rows and
row-parallel layers (proj, fc2) by columns; a rank's qkv shard holds whole query groups and
its fc1 shard is [its gate rows; its up rows].

``to_mcore`` builds one rank's shard of a megatron parameter from slices read out of the HF
files (never a whole model); ``to_hf`` builds one HF tensor from full (TP=1) megatron
tensors. Parameter names are the global ones: ``decoder.layers.<global index>...``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from . import mtp
from .delta_net import DeltaNet
from .mla import Mla

# Transformer Engine fuses the pre-attention and pre-MLP norms into the next linear layer;
# its names map to the local spec's.
_TE_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# megatron per-layer suffix -> HF per-layer suffix, for tensors that are copied as they are.
_SAME = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
# Gemma 3: its post_attention_layernorm is on the attention output (in the bias-dropout-add
# slot, models/gemma3_layers.py), the MLP's input norm is pre_feedforward_layernorm
_POST_NORMS = {
    "pre_mlp_layernorm.weight": "pre_feedforward_layernorm.weight",
    "self_attn_bda.post_norm.weight": "post_attention_layernorm.weight",
    "mlp_bda.post_norm.weight": "post_feedforward_layernorm.weight",
}
# row-parallel layers: TP shards the input (column) dimension
_ROW_PARALLEL = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}

# families whose delta nets keep Qwen3.5's four input projections (models/delta_net.py)
FLAT_DELTA_NET = ("qwen3_5", "qwen3_5_moe")
# the HF expert spelling of each family (Experts.names); the rest are Qwen's
_EXPERT_NAMES = {"mixtral": "mixtral", "deepseek_v3": "deepseek", "glm4_moe": "deepseek",
                 "gpt_oss": "gpt_oss", "qwen3_vl_moe": "stacked"}
# the spellings whose experts are whole-layer tensors (Experts.fused_*)
FUSED_NAMES = ("gpt_oss", "stacked")
# gpt-oss: each layer's experts in four fused tensors [experts, ...]; gate_up_proj is
# [hidden, 2 * ffn] per expert (the input side first) with gate and up interleaved by
# column (gate the even ones), down_proj [ffn, hidden]. Qwen3-VL-MoE ("stacked"): the first
# and third only, without biases, gate_up_proj's columns the gate's then the up's
_FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias",
                  "mlp.experts.down_proj", "mlp.experts.down_proj_bias")
_SINKS = ("self_attention.core_attention.softmax_offset", "self_attn.sinks")
_PROJ_BIAS = ("self_attention.linear_proj.bias", "self_attn.o_proj.bias")

Read = Callable[..., torch.Tensor]   # read(hf_name, rows=None, cols=None)
Get = Callable[[str], torch.Tensor]  # get(megatron_name) -> full tensor


class ConversionError(ValueError):
    """A parameter the mapping does not know (a layer type the families do not have)."""


# Transformer Engine's grouped experts (--moe_grouped_gemm): one weight per local expert.
_TE_GROUPED = re.compile(r"^mlp\.experts\.linear_fc([12])\.weight(\d+)$")


_ANY_LAYER = re.compile(r"^(decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)\.(.+)$")


def canonical(name: str) -> str:
    """A megatron parameter name in the local spec's spelling (decoder and MTP layers)."""
    match = _ANY_LAYER.match(name)
    if match and match.group(2) in _TE_NAMES:
        return f"{match.group(1)}.{_TE_NAMES[match.group(2)]}"
    grouped = _TE_GROUPED.match(match.group(2)) if match else None
    if grouped:
        return (f"{match.group(1)}.mlp.experts.local_experts."
                f"{grouped.group(2)}.linear_fc{grouped.group(1)}.weight")
    return name


@dataclass(frozen=True)
class Experts:
    """The mixture-of-experts part of a layout: which layers are MoE and their sizes.
    ``names`` is the family's HF spelling: 'qwen' (mlp.gate, mlp.experts.N.gate_proj,
    mlp.shared_expert...) or 'mixtral' (block_sparse_moe.gate, experts.N.w1/w2/w3)."""

    count: int
    ffn: int
    layers: Tuple[int, ...]      # 1: MoE, 0: dense, per layer
    shared_ffn: int = 0          # 0: no shared expert
    shared_gate: bool = False
    names: str = "qwen"
    expert_bias: bool = False    # the router's expert bias (DeepSeek-V3's correction bias)

    def fused_shapes(self, hidden: int) -> List[Tuple[str, Tuple[int, ...]]]:
        """gpt-oss's (Qwen3-VL-MoE's) fused expert tensors of one layer with their shapes."""
        e, f = self.count, self.ffn
        if self.names == "stacked":
            return [(_FUSED_EXPERTS[0], (e, hidden, 2 * f)), (_FUSED_EXPERTS[2], (e, f, hidden))]
        return list(zip(_FUSED_EXPERTS, [(e, hidden, 2 * f), (e, 2 * f), (e, f, hidden),
                                         (e, hidden)]))

    def fused_to_hf(self, suffix: str, layer: str, get: Get) -> torch.Tensor:
        """One fused HF tensor of the layer whose megatron prefix is ``layer``."""
        per = []
        for e in range(self.count):
            expert = f"{layer}mlp.experts.local_experts.{e}."
            if self.names == "stacked":  # the Hub's layout: fc1 and fc2 transposed
                fc = "linear_fc1" if suffix == _FUSED_EXPERTS[0] else "linear_fc2"
                weight = get(expert + fc + ".weight")
                # a square one in memory's layout, which transformers reads it as
                per.append(weight if weight.shape[0] == weight.shape[1] else weight.t())
            elif suffix.startswith("mlp.experts.gate_up_proj"):
                kind = "bias" if suffix.endswith("_bias") else "weight"
                gate, up = get(expert + f"linear_fc1.{kind}").chunk(2, dim=0)
                # [gate; up] rows -> columns interleaved gate, up, gate, ... (weights
                # stored input side first)
                both = torch.stack([gate, up], dim=1).flatten(0, 1)
                per.append(both.t() if kind == "weight" else both)
            elif suffix == "mlp.experts.down_proj":
                per.append(get(expert + "linear_fc2.weight").t())
            else:
                per.append(get(expert + "linear_fc2.bias"))
        return torch.stack(per).contiguous()

    def fused_to_mcore(self, expert: int, suffix: str, prefix: str, read: Read,
                       tp_rank: int, tp_size: int) -> torch.Tensor:
        """Global expert ``expert``'s linear_fc1/fc2 weight or bias (``suffix``: e.g.
        'linear_fc1.weight'), this TP rank's part, read from the fused tensors."""
        rows = slice(expert, expert + 1)
        part = _part(self.ffn, tp_rank, tp_size)
        if self.names == "stacked":
            # the Hub's files hold [hidden, 2 * ffn] and [ffn, hidden] per expert, those
            # transformers writes [2 * ffn, hidden] and [hidden, ffn] (its layout in memory);
            # either is read, the shape telling which as transformers' own loading does (a
            # square one is in memory's layout)
            if suffix == "linear_fc1.weight":
                fused = read(prefix + _FUSED_EXPERTS[0], rows=rows)[0]
                if fused.shape[0] != 2 * self.ffn:
                    fused = fused.t()
                return torch.cat([fused[: self.ffn][part], fused[self.ffn:][part]], dim=0)
            down = read(prefix + _FUSED_EXPERTS[2], rows=rows)[0]
            if down.shape[1] != self.ffn:
                down = down.t()
            return down[:, part]
        if suffix.startswith("linear_fc1."):
            name = "mlp.experts.gate_up_proj" + ("_bias" if suffix.endswith("bias") else "")
            fused = read(prefix + name, rows=rows)[0]
            if suffix.endswith("weight"):
                fused = fused.t()
            return torch.cat([fused[0::2][part], fused[1::2][part]], dim=0)
        if suffix == "linear_fc2.weight":
            return read(prefix + "mlp.experts.down_proj", rows=rows)[0].t()[:, part]
        return read(prefix + "mlp.experts.down_proj_bias", rows=rows)[0]

    def hf_names(self, i: int) -> dict:
        """megatron suffix (local spec, layer i) -> the HF suffix, for each MoE tensor."""
        out = {}
        if self.names == "gpt_oss":  # the experts: fused_to_hf / fused_to_mcore
            return {"mlp.router.weight": "mlp.router.weight",
                    "mlp.router.bias": "mlp.router.bias"}
        if self.names == "stacked":
            return {"mlp.router.weight": "mlp.gate.weight"}
        if self.names == "mixtral":
            out["mlp.router.weight"] = "block_sparse_moe.gate.weight"
            for e in range(self.count):
                base = f"block_sparse_moe.experts.{e}."
                out[f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (base + "w1.weight",
                                                                          base + "w3.weight")
                out[f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = base + "w2.weight"
            return out
        out["mlp.router.weight"] = "mlp.gate.weight"
        if self.expert_bias:
            out["mlp.router.expert_bias"] = "mlp.gate.e_score_correction_bias"
        for e in range(self.count):
            base = f"mlp.experts.{e}."
            out[f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (base + "gate_proj.weight",
                                                                      base + "up_proj.weight")
            out[f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = base + "down_proj.weight"
        if self.shared_ffn:
            # DeepSeek-V3 and GLM-4.5 say shared_experts (ungated), Qwen2-MoE shared_expert
            base = "mlp.shared_experts." if self.names == "deepseek" else "mlp.shared_expert."
            out["mlp.shared_experts.linear_fc1.weight"] = (base + "gate_proj.weight",
                                                           base + "up_proj.weight")
            out["mlp.shared_experts.linear_fc2.weight"] = base + "down_proj.weight"
            if self.shared_gate:
                out["mlp.shared_experts.gate_weight"] = "mlp.shared_expert_gate.weight"
        return out


@dataclass(frozen=True)
class Layout:
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    vocab: int           # rows of the HF embedding (config.json vocab_size)
    padded_vocab: int    # rows of megatron's embedding (padded for tensor parallelism)
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    experts: Optional[Experts] = None
    proj_bias: bool = False   # a bias on the attention output (gpt-oss's o_proj)
    sinks: bool = False       # a learned sink logit per head (gpt-oss)
    mla: Optional[Mla] = None    # multi-latent attention (models/mla.py) instead of q/k/v
    post_norms: bool = False  # Gemma 3: norms on the attention and MLP outputs
    mtp_layers: int = 0       # multi-token prediction layers after the decoder (mtp.py)
    mtp_prefixed: bool = False  # named mtp.* in the folder (Qwen3-Next: mtp.PREFIXED)
    # gated delta-net layers (Qwen3-Next, models/delta_net.py): 1 per such layer
    delta_net: Optional[DeltaNet] = None
    linear: Tuple[int, ...] = ()
    output_gate: bool = False  # q_proj also holds each head's output gate (Qwen3-Next)
    score: int = 0  # a reward model: score.weight [score, hidden] instead of lm_head
    # a vision-language model's tower (models/vision.py): (HF name, shape) of each tensor,
    # named alike in the files and the model, copied as they are
    vision: Tuple[Tuple[str, Tuple[int, ...]], ...] = ()
    # the files name the language model model.language_model.* and the tower model.visual.*
    # (Qwen3-VL's); the names below are the flat ones (model.*, visual.*) either way
    nested: bool = False

    @classmethod
    def from_model_args(cls, m, padded_vocab: int) -> "Layout":
        from ..arguments.model import linear_attention_pattern

        heads = m.num_attention_heads
        experts = None
        if getattr(m, "num_experts", None) is not None:
            from ..arguments.model import moe_layer_pattern

            experts = Experts(count=m.num_experts, ffn=m.moe_ffn_hidden_size or
                              m.ffn_hidden_size, layers=tuple(moe_layer_pattern(m)),
                              shared_ffn=m.moe_shared_expert_intermediate_size or 0,
                              shared_gate=m.moe_shared_expert_gate,
                              names=_EXPERT_NAMES.get(m.model_type, "qwen"),
                              expert_bias=m.moe_router_enable_expert_bias)
        return cls(num_layers=m.num_layers, hidden=m.hidden_size, ffn=m.ffn_hidden_size,
                   heads=heads, groups=m.num_query_groups or heads,
                   head_dim=m.kv_channels or m.hidden_size // heads,
                   vocab=m.vocab_size or padded_vocab, padded_vocab=padded_vocab,
                   tied=not m.untie_embeddings_and_output_weights,
                   proj_bias=m.add_bias_linear, sinks=m.softmax_type == "learnable",
                   qkv_bias=m.add_qkv_bias, qk_norm=m.qk_layernorm, experts=experts,
                   mla=Mla.from_model_args(m) if m.multi_latent_attention else None,
                   post_norms=m.model_type == "gemma3", mtp_layers=m.mtp_num_layers or 0,
                   mtp_prefixed=mtp.prefixed(m.model_type),
                   delta_net=DeltaNet.from_model_args(m, flat=m.model_type in FLAT_DELTA_NET)
                   if m.linear_attention_freq else None,
                   linear=tuple(linear_attention_pattern(m)),
                   output_gate=bool(m.attention_output_gate),
                   score=getattr(m, "num_labels", None) or 0,
                   vision=_vision_tensors(m),
                   nested=bool(getattr(m, "vision_config", None)) and _nested(m.model_type))

    def same(self) -> dict:
        """megatron per-layer suffix -> HF suffix of the tensors copied as they are."""
        if not self.post_norms:
            return _SAME
        return {**_SAME, **_POST_NORMS}

    def is_linear(self, layer: int) -> bool:
        """Whether HF layer ``layer`` is a delta-net layer (an MTP layer never is: Qwen3-Next's
        is a full-attention layer, models/gpt.py mtp_block_spec)."""
        if layer >= self.num_layers:
            return False
        return bool(self.linear) and bool(self.linear[layer])

    def is_moe(self, layer: int) -> bool:
        """Whether HF layer ``layer`` is MoE; an MTP layer (past the decoder's) is built like
        the decoder's last layer (models/gpt.py mtp_block_spec)."""
        layer = min(layer, self.num_layers - 1)
        return self.experts is not None and bool(self.experts.layers[layer])

    def _moe_shapes(self, layer: int) -> List[Tuple[str, Tuple[int, ...]]]:
        x, h = self.experts, self.hidden
        shapes = []
        for mc, hf in x.hf_names(layer).items():
            if mc == "mlp.router.weight":
                shapes.append((hf, (x.count, h)))
            elif mc in ("mlp.router.expert_bias", "mlp.router.bias"):
                shapes.append((hf, (x.count,)))
            elif mc == "mlp.shared_experts.gate_weight":
                shapes.append((hf, (1, h)))
            else:
                ffn = x.shared_ffn if "shared" in mc else x.ffn
                if isinstance(hf, tuple):
                    shapes += [(name, (ffn, h)) for name in hf]
                else:
                    shapes.append((hf, (h, ffn)))
        if x.names in FUSED_NAMES:
            shapes += x.fused_shapes(h)
        return shapes

    @property
    def per_group(self) -> int:
        return self.heads // self.groups

    # ---- the HF side -------------------------------------------------------------------
    def hf_tensors(self, mtp_layers: bool = True) -> List[Tuple[str, Tuple[int, ...]]]:
        """Every HF tensor of the model with its shape, in file order; the MTP layers last
        (``mtp_layers=False``: without them, as transformers' model has it)."""
        h = self.hidden
        out = [("model.embed_tokens.weight", (self.vocab, h))]
        for i in range(self.num_layers):
            out += self._layer_tensors(i)
        out.append(("model.norm.weight", (h,)))
        if self.score:  # *ForSequenceClassification: the score head, no LM head
            out.append(("score.weight", (self.score, h)))
        elif not self.tied:
            out.append(("lm_head.weight", (self.vocab, h)))
        out = out + list(self.vision) + (self.mtp_hf_tensors() if mtp_layers else [])
        return [(nested_name(n), shape) for n, shape in out] if self.nested else out

    def mtp_hf_tensors(self) -> List[Tuple[str, Tuple[int, ...]]]:
        """The tensors of the MTP layers (model.layers.<num_layers + k>.*)."""
        out = []
        for i in range(self.num_layers, self.num_layers + self.mtp_layers):
            if self.mtp_prefixed:
                before, after = mtp.prefixed_hf_tensors(self.hidden)
                prefix = f"{mtp.PREFIXED_LAYER}{i - self.num_layers}."
            else:
                prefix = f"model.layers.{i}."
                before, after = mtp.hf_extra_tensors(prefix, self.hidden, self.vocab)
            out += before + self._layer_tensors(i, prefix) + after
        return out

    def _layer_tensors(self, i: int, p: Optional[str] = None
                       ) -> List[Tuple[str, Tuple[int, ...]]]:
        """The tensors of decoder layer ``i`` (or an MTP layer's decoder-layer part, named
        from ``p``)."""
        h, hd = self.hidden, self.head_dim
        p = p or f"model.layers.{i}."
        out = [(p + "input_layernorm.weight", (h,))]
        if self.is_linear(i):
            out += self.delta_net.hf_tensors(p) + [(p + "post_attention_layernorm.weight",
                                                    (h,))]
        elif self.mla is not None:
            out += self.mla.hf_tensors(p) + [(p + "post_attention_layernorm.weight", (h,))]
        q_rows = self.heads * hd * (2 if self.output_gate else 1)
        full = self.mla is None and not self.is_linear(i)
        for proj, rows in (("q", q_rows), ("k", self.groups * hd),
                           ("v", self.groups * hd)) if full else ():
            out.append((p + f"self_attn.{proj}_proj.weight", (rows, h)))
            if self.qkv_bias:
                out.append((p + f"self_attn.{proj}_proj.bias", (rows,)))
        if self.qk_norm and full:
            out += [(p + "self_attn.q_norm.weight", (hd,)),
                    (p + "self_attn.k_norm.weight", (hd,))]
        if full:
            out.append((p + "self_attn.o_proj.weight", (h, self.heads * hd)))
            if self.proj_bias:
                out.append((p + _PROJ_BIAS[1], (h,)))
            if self.sinks:
                out.append((p + _SINKS[1], (self.heads,)))
            out.append((p + "post_attention_layernorm.weight", (h,)))
        if self.post_norms:
            out += [(p + "pre_feedforward_layernorm.weight", (h,)),
                    (p + "post_feedforward_layernorm.weight", (h,))]
        if self.is_moe(i):
            return out + [(p + name, shape) for name, shape in self._moe_shapes(i)]
        out += [(p + "mlp.gate_proj.weight", (self.ffn, h)),
                (p + "mlp.up_proj.weight", (self.ffn, h)),
                (p + "mlp.down_proj.weight", (h, self.ffn))]
        return out

    def to_hf(self, hf_name: str, get: Get) -> torch.Tensor:
        """One HF tensor from full megatron tensors (``get(name)``, TP=1 layout)."""
        if self.nested:
            hf_name = flat_name(hf_name)
        if self.vision and hf_name.startswith(_VISION):
            return get(hf_name)
        if hf_name == "model.embed_tokens.weight":
            return get("embedding.word_embeddings.weight")[: self.vocab]
        if hf_name == "lm_head.weight":
            return get("output_layer.weight")[: self.vocab]
        if hf_name == "score.weight" and self.score:
            return get("output_layer.weight")
        if hf_name == "model.norm.weight":
            return get("decoder.final_layernorm.weight")
        if self.mtp_prefixed and self.mtp_layers:
            own = {hf: mc for mc, hf in mtp.PREFIXED_NAMES.items()}
            if hf_name in own:
                return get(f"mtp.layers.0.{own[hf_name]}")
            match = re.match(r"^mtp\.layers\.(\d+)\.(.+)$", hf_name)
            if match and int(match.group(1)) < self.mtp_layers:
                k = int(match.group(1))
                return self._layer_to_hf(self.num_layers + k, match.group(2),
                                         f"mtp.layers.{k}.{mtp.TRANSFORMER_LAYER}", hf_name,
                                         get)
        match = _HF_LAYER.match(hf_name)
        if not match:
            raise ConversionError(f"no megatron counterpart for {hf_name}")
        i, suffix = int(match.group(1)), match.group(2)
        layer = f"decoder.layers.{i}."
        if self.num_layers <= i < self.num_layers + self.mtp_layers and not self.mtp_prefixed:
            k = i - self.num_layers
            if mtp.mcore_name(suffix):
                return get(f"mtp.layers.{k}.{mtp.mcore_name(suffix)}")
            if mtp.copied(suffix, self.tied):  # the model's embedding / output layer again,
                # its own tensor (safetensors writes no two names over one storage)
                return self.to_hf(mtp.copied(suffix, self.tied), get).clone()
            layer = f"mtp.layers.{k}.{mtp.TRANSFORMER_LAYER}"
        return self._layer_to_hf(i, suffix, layer, hf_name, get)

    def _layer_to_hf(self, i: int, suffix: str, layer: str, hf_name: str, get: Get
                     ) -> torch.Tensor:
        """HF tensor ``hf_name`` of layer ``i`` (suffix ``suffix``), from megatron's layer
        whose parameters start with ``layer``."""
        if self.mla is not None and self.mla.mcore_name(suffix):
            return get(layer + self.mla.mcore_name(suffix))
        if self.is_linear(i) and self.delta_net.owns_hf(suffix):
            return self.delta_net.to_hf(suffix, layer, get)
        for mc, hf in {**self.same(), **_ROW_PARALLEL, **self._attention_extras()}.items():
            if suffix == hf:
                return get(layer + mc)
        if suffix in _FUSED_EXPERTS and self.is_moe(i) and self.experts.names in FUSED_NAMES:
            return self.experts.fused_to_hf(suffix, layer, get)
        qkv = re.match(r"^self_attn\.([qkv])_proj\.(weight|bias)$", suffix)
        if qkv:
            fused = get(layer + f"self_attention.linear_qkv.{qkv.group(2)}")
            return self._split_qkv(fused)["qkv".index(qkv.group(1))]
        mlp = re.match(r"^mlp\.(gate|up)_proj\.weight$", suffix)
        if mlp and not self.is_moe(i):
            gate, up = get(layer + "mlp.linear_fc1.weight").chunk(2, dim=0)
            return gate if mlp.group(1) == "gate" else up
        if self.is_moe(i):
            for mc, hf in self.experts.hf_names(i).items():
                if isinstance(hf, tuple) and suffix in hf:  # [gate; up] of an expert
                    return get(layer + mc).chunk(2, dim=0)[hf.index(suffix)]
                if suffix == hf:
                    return get(layer + mc)
        raise ConversionError(f"no megatron counterpart for {hf_name}")

    def _attention_extras(self) -> dict:
        """megatron suffix -> HF suffix of the output bias and the sinks, where present."""
        return dict(pair for pair, present in ((_PROJ_BIAS, self.proj_bias),
                                               (_SINKS, self.sinks)) if present)

    def _split_qkv(self, fused: torch.Tensor):
        hd, n, tail = self.head_dim, self.per_group, fused.shape[1:]
        if self.output_gate:
            # megatron: per group [its queries; their gates; key; value]; HF's q_proj: per
            # head [query; gate]
            grouped = fused.reshape(self.groups, (2 * n + 2) * hd, *tail)
            q, gate, k, v = grouped.split([n * hd, n * hd, hd, hd], dim=1)
            q = torch.stack([q.reshape(self.groups, n, hd, *tail),
                             gate.reshape(self.groups, n, hd, *tail)], dim=2)
            return [t.reshape(-1, *tail) for t in (q, k, v)]
        grouped = fused.reshape(self.groups, (n + 2) * hd, *tail)
        q, k, v = grouped.split([n * hd, hd, hd], dim=1)
        return [t.reshape(-1, *tail) for t in (q, k, v)]

    # ---- the megatron side ---------------------------------------------------------------
    def to_mcore(self, name: str, read: Read, tp_rank: int = 0, tp_size: int = 1,
                 ep_rank: int = 0, ep_size: int = 1,
                 expert_tp: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        """Rank ``tp_rank``'s shard of megatron parameter ``name``, read from the HF files.
        With expert parallelism local expert j of EP rank r is global expert
        r * experts / ep_size + j; a routed expert is split over its expert-TP ranks
        (``expert_tp``: (rank, size); None: TP's)."""
        name = canonical(name)
        if self.nested:
            read = _reading_nested(read)
        if self.vision and name.startswith(_VISION):  # replicated over TP
            return read(name)
        vocab = self.vocab_source(name, tp_rank, tp_size)
        if vocab is not None:
            return self._vocab_rows(vocab, read, tp_rank, tp_size)
        if name == "output_layer.weight":  # a reward model's score head
            return read("score.weight")  # whole on every rank (models/value_head.py)
        if name == "decoder.final_layernorm.weight":
            return read("model.norm.weight")
        match = _LAYER.match(name)
        index, suffix = (int(match.group(1)), match.group(2)) if match else (None, None)
        in_mtp = mtp.MCORE_LAYER.match(name)
        prefix = f"model.layers.{index}."
        if in_mtp and int(in_mtp.group(1)) < self.mtp_layers:
            k = int(in_mtp.group(1))
            index, suffix = self.num_layers + k, in_mtp.group(2)
            prefix = f"{mtp.PREFIXED_LAYER}{k}." if self.mtp_prefixed else \
                f"model.layers.{index}."
            own = mtp.PREFIXED_NAMES.get(suffix) if self.mtp_prefixed else (
                prefix + mtp.hf_name(suffix) if mtp.hf_name(suffix) else None)
            if suffix == "eh_proj.weight":  # column-parallel: TP shards its output rows
                return read(own, rows=_part(self.hidden, tp_rank, tp_size))
            if own:
                return read(own)
            suffix = suffix[len(mtp.TRANSFORMER_LAYER):] \
                if suffix.startswith(mtp.TRANSFORMER_LAYER) else None
        if suffix is None:
            raise ConversionError(f"no Hugging Face counterpart for megatron parameter {name}")
        if self.mla is not None and self.mla.hf_name(suffix):
            return self.mla.to_mcore(suffix, prefix, read, tp_rank, tp_size)
        if self.is_linear(index) and self.delta_net.owns(suffix):
            return self.delta_net.to_mcore(suffix, prefix, read, tp_rank, tp_size)
        if suffix in self.same():
            return read(prefix + self.same()[suffix])
        if self.proj_bias and suffix == _PROJ_BIAS[0]:  # row-parallel: whole on every rank
            return read(prefix + _PROJ_BIAS[1])
        if self.sinks and suffix == _SINKS[0]:  # this rank's heads
            return read(prefix + _SINKS[1], rows=_part(self.heads, tp_rank, tp_size))
        if self.is_moe(index) and suffix.startswith("mlp.") \
                and not suffix.startswith("mlp.linear_fc"):
            return self._moe_shard(index, prefix, suffix, read, tp_rank, tp_size,
                                   ep_rank, ep_size, expert_tp or (tp_rank, tp_size))
        if suffix in _ROW_PARALLEL:
            width = self.heads * self.head_dim if "linear_proj" in suffix else self.ffn
            return read(prefix + _ROW_PARALLEL[suffix], cols=_part(width, tp_rank, tp_size))
        if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = suffix.rsplit(".", 1)[1]
            return self._qkv_shard(prefix, kind, read, tp_rank, tp_size)
        if suffix == "mlp.linear_fc1.weight":
            rows = _part(self.ffn, tp_rank, tp_size)
            return torch.cat([read(prefix + "mlp.gate_proj.weight", rows=rows),
                              read(prefix + "mlp.up_proj.weight", rows=rows)], dim=0)
        raise ConversionError(f"no Hugging Face counterpart for megatron parameter {name}")

    def _moe_shard(self, layer: int, prefix: str, suffix: str, read: Read, tp_rank: int,
                   tp_size: int, ep_rank: int, ep_size: int,
                   expert_tp: Tuple[int, int]) -> torch.Tensor:
        """A router, routed-expert or shared-expert tensor of MoE layer ``layer``; the
        routed experts' fc1/fc2 are sharded over the expert-TP ranks, the shared expert's
        over TP, like the dense MLP's."""
        x = self.experts
        local = re.match(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$", suffix)
        if local:
            tp_rank, tp_size = expert_tp
            suffix = (f"mlp.experts.local_experts."
                      f"{ep_rank * (x.count // ep_size) + int(local.group(1))}.{local.group(2)}")
        if local and x.names in FUSED_NAMES:
            expert, rest = suffix.split(".")[3], local.group(2)
            return x.fused_to_mcore(int(expert), rest, prefix, read, tp_rank, tp_size)
        hf = x.hf_names(layer).get(suffix)
        if hf is None:
            raise ConversionError(f"no Hugging Face counterpart for megatron parameter "
                                  f"{prefix}{suffix}")
        if suffix in ("mlp.router.weight", "mlp.router.expert_bias", "mlp.router.bias",
                      "mlp.shared_experts.gate_weight"):
            return read(prefix + hf)
        ffn = x.shared_ffn if "shared" in suffix else x.ffn
        if isinstance(hf, tuple):  # fc1: [gate; up], this TP rank's rows of each
            rows = _part(ffn, tp_rank, tp_size)
            return torch.cat([read(prefix + name, rows=rows) for name in hf], dim=0)
        return read(prefix + hf, cols=_part(ffn, tp_rank, tp_size))

    def _qkv_shard(self, prefix: str, kind: str, read: Read, tp_rank: int, tp_size: int):
        hd, n = self.head_dim, self.per_group
        local = self.groups // tp_size
        first = tp_rank * local
        if self.output_gate:  # HF: per head [query; gate]; megatron: [queries; gates]
            both = read(prefix + f"self_attn.q_proj.{kind}",
                        rows=slice(first * n * 2 * hd, (first + local) * n * 2 * hd))
            tail = both.shape[1:]
            both = both.reshape(local, n, 2, hd, *tail)
            q = torch.cat([both[:, :, 0].reshape(local, n * hd, *tail),
                           both[:, :, 1].reshape(local, n * hd, *tail)], dim=1)
            n_rows = 2 * n * hd
        else:
            q = read(prefix + f"self_attn.q_proj.{kind}",
                     rows=slice(first * n * hd, (first + local) * n * hd))
            n_rows = n * hd
        k = read(prefix + f"self_attn.k_proj.{kind}", rows=slice(first * hd, (first + local) * hd))
        v = read(prefix + f"self_attn.v_proj.{kind}", rows=slice(first * hd, (first + local) * hd))
        tail = k.shape[1:]
        fused = torch.cat([q.reshape(local, n_rows, *tail), k.reshape(local, hd, *tail),
                           v.reshape(local, hd, *tail)], dim=1)
        return fused.reshape(-1, *tail)

    def vocab_source(self, name: str, tp_rank: int = 0, tp_size: int = 1
                     ) -> Optional[Tuple[str, int, int]]:
        """For the embedding and the LM head: the HF tensor (as the files name it) that rank
        ``tp_rank``'s rows of the padded vocabulary come from, and which of its rows (start,
        stop); the rank's rows past ``stop`` are padding. None for any other parameter."""
        name = canonical(name)
        if name == "embedding.word_embeddings.weight":
            hf_name = "model.embed_tokens.weight"
        elif name == "output_layer.weight" and not self.score:
            hf_name = "model.embed_tokens.weight" if self.tied else "lm_head.weight"
        else:
            return None
        per = self.padded_vocab // tp_size
        start = tp_rank * per
        if self.nested:  # the name the files use
            hf_name = nested_name(hf_name)
        return hf_name, start, max(start, min(start + per, self.vocab))

    def _vocab_rows(self, source: Tuple[str, int, int], read: Read, tp_rank: int,
                    tp_size: int) -> torch.Tensor:
        """This rank's rows of the (padded) vocabulary; padding rows are zero."""
        hf_name, start, stop = source
        per = self.padded_vocab // tp_size
        real = read(hf_name, rows=slice(start, stop)) if stop > start else None
        if real is not None and real.shape[0] == per:
            return real
        out = torch.zeros(per, self.hidden, dtype=real.dtype if real is not None else
                          torch.float32)
        if real is not None:
            out[: real.shape[0]] = real
        return out


_VISION = "visual."
_NESTED_LM, _NESTED_VISION = "model.language_model.", "model.visual."


def _nested(model_type) -> bool:
    from .vision import NESTED_NAMES

    return model_type in NESTED_NAMES


def nested_name(name: str) -> str:
    """A flat HF name (model.*, visual.*) as a nested folder's files spell it."""
    if name.startswith((_NESTED_LM, _NESTED_VISION)):
        return name
    if name.startswith(_VISION):
        return "model." + name
    if name.startswith("model."):
        return _NESTED_LM + name[len("model."):]
    return name


def flat_name(name: str) -> str:
    """The flat HF name of a nested folder's tensor name (the inverse of nested_name)."""
    if name.startswith(_NESTED_VISION):
        return name[len("model."):]
    if name.startswith(_NESTED_LM):
        return "model." + name[len(_NESTED_LM):]
    return name


def _reading_nested(read: Read) -> Read:
    def nested_read(name, *args, **kwargs):
        return read(nested_name(name), *args, **kwargs)
    return nested_read


def _vision_tensors(m) -> Tuple[Tuple[str, Tuple[int, ...]], ...]:
    if not getattr(m, "vision_config", None):
        return ()
    from .vision import VisionLanguage, tower_shapes

    return tower_shapes(VisionLanguage.from_model_args(m))


def _part(size: int, rank: int, parts: int) -> slice:
    step = size // parts
    return slice(rank * step, (rank + 1) * step)


def layer_offset(chunk) -> int:
    """Global index of a model chunk's first transformer layer (pipeline stages)."""
    layers = getattr(getattr(chunk, "decoder", None), "layers", None)
    if layers is None or len(layers) == 0:
        return 0
    return layers[0].layer_number - 1


def global_name(local: str, offset: int) -> str:
    match = _LAYER.match(local)
    if not match or offset == 0:
        return local
    return f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}"

