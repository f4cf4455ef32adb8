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
(``tests/test_cpu_compat.py``). It takes cos and sin once per freqs tensor (megatron's
``RotaryEmbedding`` returns the same one to every layer and micro-batch) where megatron
takes them on every call. It handles what the fast path covers (the whole head
rotated, not interleaved, no multi-latent attention) and hands anything else to megatron's
own function. ``cpu_compat.py`` installs it without CUDA.
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


class _CosSinCache:
    """cos and sin of the last few freqs tensors. megatron's ``RotaryEmbedding.forward`` is
    an ``lru_cache``: every layer, q and k, and every micro-batch of a run get the same
    freqs tensor, of which megatron takes cos and sin again each time (2 x layers x 2 per
    micro-batch). An entry holds its freqs tensor, so the identity it is found by cannot be
    reused by another tensor, and the version counter catches a freqs changed in place."""

    SIZE = 4

    def __init__(self):
        self.entries = []  # (freqs, version, mscale, dtype, inference, cos, sin), newest last

    def get(self, freqs, mscale, dtype):
        inference = torch.is_inference_mode_enabled()
        for entry in self.entries:
            if (entry[0] is freqs and entry[1] == freqs._version and entry[2] == mscale
                    and entry[3] == dtype and entry[4] == inference):
                return entry[5], entry[6]
        # cos and sin exactly as megatron forms them (rope_utils.py:122-123).
        cos = (torch.cos(freqs) * mscale).to(dtype)
        sin = (torch.sin(freqs) * mscale).to(dtype)
        self.entries = [*self.entries[-(self.SIZE - 1):],
                        (freqs, freqs._version, mscale, dtype, inference, cos, sin)]
        return cos, sin


cos_sin = _CosSinCache().get


def make_apply_rotary_bshd(original):
    """A drop-in for megatron's ``_apply_rotary_pos_emb_bshd`` (same signature) that takes
    the fast path where it applies and calls ``original`` everywhere else."""

    def apply_rotary_bshd(t, freqs, rotary_interleaved=False, multi_latent_attention=False,
                          mscale=1.0):
        if not fast_path_applies(t, freqs, rotary_interleaved, multi_latent_attention):
            return original(t, freqs, rotary_interleaved=rotary_interleaved,
                            multi_latent_attention=multi_latent_attention, mscale=mscale)
        cos, sin = cos_sin(freqs, mscale, t.dtype)
        return _RotaryBshd.apply(t, cos, sin)

    apply_rotary_bshd._swift_mcore_original = original
    return apply_rotary_bshd
