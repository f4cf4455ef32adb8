"""torch's LayerNorm/RMSNorm for the local layer spec with --sequence_parallel.

megatron-core's own torch norm (``WrappedTorchNorm``) asserts that sequence parallelism is
off: with it each tensor-parallel rank normalises only its slice of the sequence, so the
norm's weight gradient on one rank is a partial sum. megatron already sums such partial
gradients over the TP ranks after the backward pass (``finalize_model_grads``), for every
parameter marked ``sequence_parallel`` (Transformer Engine's and apex's norms mark theirs,
and so does megatron's router weight). This norm is torch's, with that mark: the same
forward, and the gradients of the whole sequence once megatron has reduced them.
"""

from __future__ import annotations

import torch


class SequenceParallelNorm:
    """Builds torch.nn.LayerNorm or torch.nn.RMSNorm (config.normalization) as megatron's
    ``WrappedTorchNorm`` does, its parameters marked ``sequence_parallel`` when
    config.sequence_parallel is on."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        classes = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in classes:
            raise ValueError(f"normalization {config.normalization!r}: LayerNorm or RMSNorm")
        norm = classes[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def use_in(spec) -> None:
    """Puts SequenceParallelNorm in the norm slots of a local transformer-layer spec that
    hold megatron's torch norm (the layer's two norms, the attention's q/k norms, MLA's latent norms); apex's
    fused LayerNorm supports sequence parallelism itself and stays."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    layer = spec.submodules
    for owner, name in ((layer, "input_layernorm"), (layer, "pre_mlp_layernorm"),
                        (layer.self_attention.submodules, "q_layernorm"),
                        (layer.self_attention.submodules, "k_layernorm"),
                        # multi-latent attention's latent norms (on the sequence shard)
                        (layer.self_attention.submodules, "kv_layernorm")):
        if getattr(owner, name, None) is WrappedTorchNorm:
            setattr(owner, name, SequenceParallelNorm)
