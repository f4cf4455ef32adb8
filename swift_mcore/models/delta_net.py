"""The gated delta net's weights between Hugging Face (Qwen3-Next's linear_attn) and
megatron-core's GatedDeltaNet, both ways, with tensor parallelism.

Hugging Face (Qwen3NextGatedDeltaNet)   megatron (GatedDeltaNet)
  in_proj_qkvz, in_proj_ba               in_proj
  conv1d, dt_bias, A_log                 conv1d, dt_bias, A_log
  norm (gated RMSNorm, weight x)         out_norm (RMSNorm, weight x)
  out_proj                               out_proj

transformers groups ``in_proj_qkvz`` per key head: for each key head its query, its key,
then the values and the output gates (z) of the value heads it serves; ``in_proj_ba`` per
key head the betas then the alphas of those value heads. megatron's ``in_proj`` holds the
six parts one after the other: [all queries; all keys; all values; all z; all betas; all
alphas], value head j of key head i at i * (value heads / key heads) + j in both. The
conv1d channels are [queries; keys; values] in both. Tensor parallelism shards each of the
six parts (and the conv1d's three) by its rows: a rank holds whole key heads and the value
heads they serve (gated_delta_net.py's split of the local in_proj).

Qwen3.5 (``flat``) keeps the same parts in four projections, each in megatron's order
already: ``in_proj_qkv`` ([queries; keys; values]), ``in_proj_z``, ``in_proj_b``,
``in_proj_a``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch

# megatron suffix -> HF suffix of the tensors whose rows (or columns) are only sliced for TP
_NAMES = {
    "self_attention.conv1d.weight": "linear_attn.conv1d.weight",
    "self_attention.dt_bias": "linear_attn.dt_bias",
    "self_attention.A_log": "linear_attn.A_log",
    "self_attention.out_norm.weight": "linear_attn.norm.weight",
    "self_attention.out_proj.weight": "linear_attn.out_proj.weight",
}
IN_PROJ = "self_attention.in_proj.weight"
QKVZ, BA = "linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"
FLAT = ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
        "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight")


@dataclass(frozen=True)
class DeltaNet:
    """The delta-net shapes of one model (every linear-attention layer has the same)."""

    hidden: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    flat: bool = False  # Qwen3.5's four projections instead of Qwen3-Next's grouped two

    @classmethod
    def from_model_args(cls, m, flat: bool = False) -> "DeltaNet":
        return cls(hidden=m.hidden_size, key_heads=m.linear_num_key_heads,
                   value_heads=m.linear_num_value_heads, key_dim=m.linear_key_head_dim,
                   value_dim=m.linear_value_head_dim, conv_kernel=m.linear_conv_kernel_dim,
                   flat=flat)

    def projections(self) -> Tuple[str, ...]:
        """The HF names of the input projections."""
        return FLAT if self.flat else (QKVZ, BA)

    @property
    def per_key(self) -> int:
        return self.value_heads // self.key_heads

    @property
    def qk(self) -> int:
        return self.key_heads * self.key_dim

    @property
    def v(self) -> int:
        return self.value_heads * self.value_dim

    def hf_tensors(self, prefix: str) -> List[Tuple[str, Tuple[int, ...]]]:
        """The linear_attn tensors of one layer with their shapes."""
        h, conv = self.hidden, 2 * self.qk + self.v
        if self.flat:
            out = [(FLAT[0], (2 * self.qk + self.v, h)), (FLAT[1], (self.v, h)),
                   (FLAT[2], (self.value_heads, h)), (FLAT[3], (self.value_heads, h))]
        else:
            out = [(QKVZ, (2 * self.qk + 2 * self.v, h)), (BA, (2 * self.value_heads, h))]
        out += [("linear_attn.conv1d.weight", (conv, 1, self.conv_kernel)),
               ("linear_attn.dt_bias", (self.value_heads,)),
               ("linear_attn.A_log", (self.value_heads,)),
               ("linear_attn.norm.weight", (self.value_dim,)),
               ("linear_attn.out_proj.weight", (h, self.v))]
        return [(prefix + name, shape) for name, shape in out]

    def owns(self, mcore_suffix: str) -> bool:
        return mcore_suffix == IN_PROJ or mcore_suffix in _NAMES

    def owns_hf(self, hf_suffix: str) -> bool:
        return hf_suffix in self.projections() or hf_suffix in _NAMES.values()

    # ---- HF -> megatron ------------------------------------------------------------------
    def to_mcore(self, suffix: str, prefix: str, read: Callable[..., torch.Tensor],
                 tp_rank: int = 0, tp_size: int = 1) -> torch.Tensor:
        """Rank ``tp_rank``'s shard of megatron tensor ``suffix`` of HF layer ``prefix``."""
        if suffix == IN_PROJ and self.flat:
            qkv, z, b, a = (read(prefix + name) for name in FLAT)
            parts = [*qkv.split([self.qk, self.qk, self.v], dim=0), z, b, a]
            return torch.cat([_rows(p, tp_rank, tp_size) for p in parts], dim=0)
        if suffix == IN_PROJ:
            parts = self.split_hf(read(prefix + QKVZ), read(prefix + BA))
            return torch.cat([_rows(p, tp_rank, tp_size) for p in parts], dim=0)
        hf = read(prefix + _NAMES[suffix])
        if suffix == "self_attention.conv1d.weight":
            parts = hf.split([self.qk, self.qk, self.v], dim=0)
            return torch.cat([_rows(p, tp_rank, tp_size) for p in parts], dim=0)
        if suffix == "self_attention.out_proj.weight":
            return _cols(hf, tp_rank, tp_size)
        if suffix == "self_attention.out_norm.weight":
            return hf
        return _rows(hf, tp_rank, tp_size)  # dt_bias, A_log: per value head

    def split_hf(self, qkvz: torch.Tensor, ba: torch.Tensor) -> List[torch.Tensor]:
        """[q, k, v, z, beta, alpha] rows, each whole, in megatron's head order."""
        n, kd, vd = self.per_key, self.key_dim, self.value_dim
        grouped = qkvz.reshape(self.key_heads, 2 * kd + 2 * n * vd, -1)
        q, k, v, z = grouped.split([kd, kd, n * vd, n * vd], dim=1)
        b, a = ba.reshape(self.key_heads, 2 * n, -1).split([n, n], dim=1)
        return [t.reshape(-1, qkvz.shape[-1]) for t in (q, k, v, z, b, a)]

    # ---- megatron -> HF ------------------------------------------------------------------
    def to_hf(self, hf_suffix: str, layer: str, get: Callable[[str], torch.Tensor]
              ) -> torch.Tensor:
        """HF tensor ``hf_suffix`` from the full (TP=1) megatron tensors of ``layer``."""
        if hf_suffix in self.projections():
            full = get(layer + IN_PROJ)
            q, k, v, z, b, a = full.split([self.qk, self.qk, self.v, self.v, self.value_heads,
                                           self.value_heads], dim=0)
            if self.flat:
                return {FLAT[0]: torch.cat([q, k, v], dim=0), FLAT[1]: z, FLAT[2]: b,
                        FLAT[3]: a}[hf_suffix]
            heads, cols = self.key_heads, full.shape[-1]
            if hf_suffix == QKVZ:
                pieces = [t.reshape(heads, -1, cols) for t in (q, k, v, z)]
            else:
                pieces = [t.reshape(heads, -1, cols) for t in (b, a)]
            return torch.cat(pieces, dim=1).reshape(-1, cols)
        return get(layer + {hf: mc for mc, hf in _NAMES.items()}[hf_suffix])

    def mcore_names(self) -> Dict[str, str]:
        """megatron suffix -> HF suffix(es) of one linear-attention layer."""
        return {IN_PROJ: self.projections(), **_NAMES}


def _rows(t: torch.Tensor, rank: int, parts: int) -> torch.Tensor:
    step = t.shape[0] // parts
    return t[rank * step:(rank + 1) * step]


def _cols(t: torch.Tensor, rank: int, parts: int) -> torch.Tensor:
    step = t.shape[1] // parts
    return t[:, rank * step:(rank + 1) * step]
