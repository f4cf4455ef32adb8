"""The gated delta rule and its q/k L2 norm in plain torch: fla's kernels for megatron's
GatedDeltaNet on a machine without CUDA.

megatron-core 0.16.1's ``GatedDeltaNet`` (ssm/gated_delta_net.py) refuses to be built
without the flash-linear-attention package (103) and calls fla's ``l2norm`` (349) and
``chunk_gated_delta_rule`` (382), Triton kernels that need a GPU. ``install`` puts the two
functions below in their place (and the CPU torch of cpu_compat in the module, for the
``torch.cuda.current_device()`` its parameters are created on, 173-245); the layer itself,
its projections, its causal conv1d (torch's ``nn.Conv1d`` when the causal-conv1d package is
absent) and its gated norm stay megatron's.

The rule, per head with state S (key dim x value dim), decay g_t <= 0 (log space) and
write strength beta_t: S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - k_t^T exp(g_t) S_{t-1})^T,
o_t = S_t^T q_t / sqrt(key dim). ``chunk_gated_delta_rule`` computes it 64 tokens at a
time: inside a chunk the writes are one triangular solve (the UT transform), across chunks
the state is carried. Everything runs in float32; the output has the input's dtype.
With ``cu_seqlens`` (fla's packed layout: batch 1, documents back to back) each document
starts from its own initial state (zero by default), so no state crosses a boundary.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

CHUNK = 64


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) along ``dim`` (fla's l2norm), computed in float32."""
    x32 = x.float()
    return (x32 * torch.rsqrt((x32 * x32).sum(dim=dim, keepdim=True) + eps)).to(x.dtype)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           g: torch.Tensor, beta: torch.Tensor, scale: Optional[float] = None,
                           initial_state: Optional[torch.Tensor] = None,
                           output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens: Optional[torch.Tensor] = None,
                           chunk_size: int = CHUNK, **_unused
                           ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """fla's ``chunk_gated_delta_rule``: q, k [B, T, H, K]; v [B, T, Hv, V] (Hv a multiple
    of H: each q/k head serves Hv / H consecutive value heads); g, beta [B, T, Hv];
    initial_state [B (or documents), Hv, K, V]. Returns the output [B, T, Hv, V] and, when
    asked, the final state of each sequence (or document)."""
    if cu_seqlens is None:
        return _rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                     use_qk_l2norm_in_kernel, chunk_size)
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs the documents in one row (batch 1), got batch "
                         f"{q.shape[0]}")
    bounds = [int(b) for b in cu_seqlens.tolist()]
    outputs, states = [], []
    for n, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        piece = slice(start, stop)
        state = None if initial_state is None else initial_state[n: n + 1]
        out, final = _rule(q[:, piece], k[:, piece], v[:, piece], g[:, piece],
                           beta[:, piece], scale, state, output_final_state,
                           use_qk_l2norm_in_kernel, chunk_size)
        outputs.append(out)
        states.append(final)
    output = torch.cat(outputs, dim=1)
    return output, torch.cat(states, dim=0) if output_final_state else None


def _rule(q, k, v, g, beta, scale, initial_state, output_final_state, normalize, chunk):
    dtype = q.dtype
    batch, length, heads, key_dim = k.shape
    value_heads, value_dim = v.shape[-2:]
    if length == 0:
        empty = v.new_zeros(batch, 0, value_heads, value_dim)
        state = (torch.zeros(batch, value_heads, key_dim, value_dim) if initial_state is None
                 else initial_state.float())
        return empty, state if output_final_state else None
    if heads != value_heads:
        q = q.repeat_interleave(value_heads // heads, dim=2)
        k = k.repeat_interleave(value_heads // heads, dim=2)
    # [B, H, T, ...] in float32
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    g, beta = (x.transpose(1, 2).float() for x in (g, beta))
    if normalize:
        q, k = l2norm(q), l2norm(k)
    q = q * (key_dim ** -0.5 if scale is None else scale)

    pad = -length % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    chunks = (length + pad) // chunk

    def split(x):  # [B, H, T, D] -> [B, H, chunks, chunk, D]
        return x.reshape(batch, value_heads, chunks, chunk, x.shape[-1])

    q, k, v = split(q), split(k), split(v)
    beta = beta.reshape(batch, value_heads, chunks, chunk, 1)
    decay = g.reshape(batch, value_heads, chunks, chunk).cumsum(-1)  # log decay from chunk start
    # exp(decay_i - decay_j) for j <= i, 0 above the diagonal
    causal = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    between = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()

    k_beta = k * beta
    decay_exp = decay.exp().unsqueeze(-1)
    # The writes inside a chunk: (I + strictly_lower(k_beta k^T * between))^-1 applied to
    # beta v and to the decayed beta k (the part of each write the earlier state predicts),
    # both in one triangular solve.
    system = (k_beta @ k.transpose(-1, -2)) * between
    u, w = torch.linalg.solve_triangular(
        system, torch.cat([v * beta, k_beta * decay_exp], dim=-1), upper=False,
        unitriangular=True).split([value_dim, key_dim], dim=-1)
    k_to_end = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    chunk_decay = decay[..., -1].exp()[..., None, None]

    state = (torch.zeros(batch, value_heads, key_dim, value_dim) if initial_state is None
             else initial_state.float())
    # Only the state is carried from chunk to chunk; each chunk's output is then one
    # batched product over all chunks.
    states, fresh = [], []
    # unbind, not indexing: its backward stacks once instead of zero-filling per chunk
    for u_c, w_c, k_c, decay_c in zip(u.unbind(2), w.unbind(2),
                                      k_to_end.transpose(-1, -2).unbind(2),
                                      chunk_decay.unbind(2)):
        states.append(state)
        fresh.append(u_c - w_c @ state)
        state = state * decay_c + k_c @ fresh[-1]
    starts, fresh = torch.stack(states, dim=2), torch.stack(fresh, dim=2)
    scores = (q @ k.transpose(-1, -2)) * between
    out = (q * decay_exp) @ starts + scores @ fresh
    out = out.reshape(batch, value_heads, chunks * chunk, value_dim)[:, :, :length]
    return out.transpose(1, 2).contiguous().to(dtype), state if output_final_state else None


def install(cpu_torch) -> None:
    """megatron's GatedDeltaNet builds and runs on the CPU: fla's two functions are these,
    and the module's ``torch`` is ``cpu_torch`` (cpu_compat's proxy)."""
    from megatron.core.ssm import gated_delta_net

    gated_delta_net.torch = cpu_torch
    gated_delta_net.l2norm = l2norm
    gated_delta_net.chunk_gated_delta_rule = chunk_gated_delta_rule
    gated_delta_net.HAVE_FLA = True
