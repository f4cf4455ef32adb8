"""Softmax attention over blocks of keys, each block's mask built from positions: no dense mask.

The CPU context-parallel attention (all_gather_attention.py) lets a rank's queries (two
chunks of the sequence, at known global positions) attend to the whole sequence's keys.
Given to torch's SDPA, the mask over them is a dense [seq/CP, seq] tensor that its CPU
kernel keeps (as floats) for the backward pass, so memory grows with the square of the
sequence. ``blocked_attention`` is the same attention computed the flash-attention way:
the forward pass walks the keys in blocks with a running maximum and sum (online softmax),
the mask of one block at a time built from the query and key positions (causal, a sliding
window) and the packed rows' hiding mask when there is one, blocks that no query sees
skipped; it keeps only the queries, keys, values, output and log-sum-exp, and the backward
pass walks the blocks again. Dropout masks are drawn per block from a seed taken from the
caller's generator, so the backward pass draws the same ones.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

KEY_BLOCK = 256  # keys per block: the transient scores are [batch, heads, queries, KEY_BLOCK]


class Visibility:
    """Which keys each query sees: ``q_pos`` the queries' sequence positions, ``causal``,
    ``window`` megatron's (left, right) (-1 unbounded) or None, ``hidden`` a boolean
    [b|1, 1, sq, sk] mask that hides (the packed rows') or None."""

    def __init__(self, q_pos: torch.Tensor, causal: bool, window: Optional[Tuple[int, int]],
                 hidden: Optional[torch.Tensor]):
        self.q_pos, self.causal, self.window, self.hidden = q_pos, causal, window, hidden

    def block(self, start: int, stop: int) -> Optional[torch.Tensor]:
        """keep[b|1, 1, 1, sq, stop - start] for keys start..stop-1 (broadcast over the
        query groups and the heads of a group), None where every query sees every key,
        or False where none sees any."""
        q = self.q_pos[:, None]
        k = torch.arange(start, stop, device=q.device)[None, :]
        keep = None

        def both(more):
            return more if keep is None else keep & more

        if self.hidden is not None:
            keep = ~self.hidden[..., start:stop]
        elif self.causal:
            keep = both(k <= q)
        if self.window is not None:
            left, right = self.window
            if right >= 0:
                keep = both(k <= q + right)
            if left >= 0:
                keep = both(k >= q - left)
        if keep is None:
            return None
        if not bool(keep.any()):
            return False
        if bool(keep.all()):
            return None
        while keep.dim() < 4:
            keep = keep[None]
        return keep[:, :, None]  # [b|1, 1, 1, sq, block]

    def blocks(self, sk: int):
        """(n, start, stop, keep) of each block of KEY_BLOCK keys of ``sk`` that some query
        sees (keep: ``block``'s), the n-th: the forward and backward passes walk the same."""
        for n, start in enumerate(range(0, sk, KEY_BLOCK)):
            stop = min(start + KEY_BLOCK, sk)
            keep = self.block(start, stop)
            if keep is not False:
                yield n, start, stop, keep


def _dropout_keep(seed: int, block: int, shape, p: float, device) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + block)
    return (torch.rand(shape, generator=gen, device=device) >= p).to(torch.float32) / (1 - p)


class _BlockedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, visibility, scale, dropout_p, seed):
        # q [b, g, r, sq, d] (r heads share each of the g key/value groups), k, v [b, g, 1, sk, d]
        work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        qs = q.to(work) * scale
        shape = qs.shape[:-1]
        top = torch.full(shape, float("-inf"), dtype=work, device=q.device)
        total = torch.zeros(shape, dtype=work, device=q.device)
        acc = torch.zeros(*shape, v.shape[-1], dtype=work, device=q.device)
        for n, start, stop, keep in visibility.blocks(k.shape[-2]):
            scores = qs @ k[..., start:stop, :].to(work).transpose(-1, -2)
            if keep is not None:
                scores = scores.masked_fill(~keep, float("-inf"))
            new_top = torch.maximum(top, scores.amax(-1))
            safe = torch.where(new_top.isinf(), torch.zeros_like(new_top), new_top)
            probs = torch.exp(scores - safe[..., None])
            rescale = torch.exp(top - safe)
            total = total * rescale + probs.sum(-1)
            if dropout_p:
                probs = probs * _dropout_keep(seed, n, probs.shape, dropout_p, q.device)
            acc = acc * rescale[..., None] + probs @ v[..., start:stop, :].to(work)
            top = new_top
        seen = total > 0  # a query that sees no key gets zeros (and no gradient)
        out = acc / torch.where(seen, total, torch.ones_like(total))[..., None]
        lse = torch.where(seen, top + torch.log(torch.where(seen, total, 1.0)),
                          torch.full_like(top, float("inf")))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.visibility, ctx.scale, ctx.dropout_p, ctx.seed = visibility, scale, dropout_p, seed
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        visibility, scale, dropout_p, seed = ctx.visibility, ctx.scale, ctx.dropout_p, ctx.seed
        work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        qs = q.to(work) * scale
        dout = grad_out.to(work)
        delta = (dout * out.to(work)).sum(-1, keepdim=True)
        dq = torch.zeros_like(qs)
        dk = torch.zeros(k.shape, dtype=work, device=k.device)
        dv = torch.zeros(v.shape, dtype=work, device=v.device)
        for n, start, stop, keep in visibility.blocks(k.shape[-2]):
            kb, vb = k[..., start:stop, :].to(work), v[..., start:stop, :].to(work)
            probs = torch.exp(qs @ kb.transpose(-1, -2) - lse[..., None])
            if keep is not None:
                probs = probs.masked_fill(~keep, 0.0)
            dprobs = dout @ vb.transpose(-1, -2)
            kept = probs
            if dropout_p:
                drop = _dropout_keep(seed, n, probs.shape, dropout_p, q.device)
                kept, dprobs = probs * drop, dprobs * drop
            # summed over the heads that share a key/value group (dim 2)
            dv[..., start:stop, :] += (kept.transpose(-1, -2) @ dout).sum(2, keepdim=True)
            dscores = probs * (dprobs - delta)
            dq += dscores @ kb
            dk[..., start:stop, :] += (dscores.transpose(-1, -2) @ qs).sum(2, keepdim=True)
        # qs carries the scale: d(scores)/dk = qs, d(scores)/dq = scale * k
        return ((dq * scale).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                None, None, None, None)


def blocked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      visibility: Visibility, scale: float, dropout_p: float = 0.0
                      ) -> torch.Tensor:
    """query [b, heads, sq, d], key/value [b, groups, sk, d] (head i uses group
    i // (heads / groups), as SDPA's enable_gqa) -> [b, heads, sq, d_v]."""
    b, heads, sq, d = query.shape
    groups = key.shape[1]
    q = query.reshape(b, groups, heads // groups, sq, d)
    k, v = key[:, :, None], value[:, :, None]
    seed = int(torch.randint(0, 2 ** 62, (1,))) if dropout_p else 0
    out = _BlockedAttention.apply(q, k, v, visibility, scale, dropout_p, seed)
    return out.reshape(b, heads, sq, value.shape[-1])
