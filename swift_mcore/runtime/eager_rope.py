"""RoPE for megatron's unfused path, written for eager execution: the same values, fewer copies.

Without Transformer Engine megatron-core applies rotary embeddings with
``rope_utils._apply_rotary_pos_emb_bshd``: it slices the rotated part off ``t``, computes
``t * cos + rotate_half(t) * sin`` where ``rotate_half`` concatenates ``(-t2, t1)``, and
concatenates the (empty, when the whole head rotates) rest back on. Under autograd that is
two full copies in the forward (the two ``cat``) and, in the backward, a zero-filled copy
for the slice and another ``cat`` for ``chunk``: per layer and micro-batch, for q and for
k. On a GPU those are fused kernels (TE's, or torch.compile's); on CPU they run one by one.

``apply_rotary_bshd`` computes the same two products per half and subtracts or adds them
in place: ``t1*cos1 - t2*sin1`` is, bit for bit, ``t1*cos1 + (-t2)*sin1`` (negation and
a - b = a + (-b) are exact), and the backward is the transposed rotation of the same
products, so outputs and gradients equal megatron's exactly
(``tests/test_cpu_compat.py``). It handles what the fast path covers (the whole head
rotated, not interleaved, no multi-latent attention) and hands anything else to megatron's
own function. ``runtime/cpu_compat.py`` installs it without CUDA.
"""

from __future__ import annotations

import torch


class _RotaryBshd(torch.autograd.Function):
    """out = t * cos + rotate_half(t) * sin, halves along the last dimension; cos and sin
    carry no gradient (megatron's freqs are a buffer)."""

    @staticmethod
    def forward(ctx, t, cos, sin):
        half = t.shape[-1] // 2
        out = t * cos
        out[..., :half].sub_(t[..., half:] * sin[..., :half])
        out[..., half:].add_(t[..., :half] * sin[..., half:])
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        half = grad.shape[-1] // 2
        # The transpose of the rotation: what autograd gives megatron's graph, in place.
        grad_t = grad * cos
        grad_t[..., :half].add_(grad[..., half:] * sin[..., half:])
        grad_t[..., half:].sub_(grad[..., :half] * sin[..., :half])
        return grad_t, None, None


def fast_path_applies(t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool,
                      multi_latent_attention: bool) -> bool:
    return (not rotary_interleaved and not multi_latent_attention
            and freqs.shape[-1] == t.shape[-1] and t.shape[-1] % 2 == 0
            and not freqs.requires_grad)


def make_apply_rotary_bshd(original):
    """A drop-in for megatron's ``_apply_rotary_pos_emb_bshd`` (same signature) that takes
    the fast path where it applies and calls ``original`` everywhere else."""

    def apply_rotary_bshd(t, freqs, rotary_interleaved=False, multi_latent_attention=False,
                          mscale=1.0):
        if not fast_path_applies(t, freqs, rotary_interleaved, multi_latent_attention):
            return original(t, freqs, rotary_interleaved=rotary_interleaved,
                            multi_latent_attention=multi_latent_attention, mscale=mscale)
        # cos and sin exactly as megatron forms them (rope_utils.py:122-123).
        cos = (torch.cos(freqs) * mscale).to(t.dtype)
        sin = (torch.sin(freqs) * mscale).to(t.dtype)
        return _RotaryBshd.apply(t, cos, sin)

    apply_rotary_bshd._swift_mcore_original = original
    return apply_rotary_bshd
