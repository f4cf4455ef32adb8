"""What swift-mcore's adaptations of megatron-core share: the versions they were tested with
(one check refuses any other unless SWIFT_MCORE_ALLOW_UNTESTED_MCORE=1), the module
look-alike a patched megatron module gets in place of torch or numpy, and the fixes every
machine needs, CPU or GPU: the MoE router's GEMM without Transformer Engine and its padding
mask (the multi-token-prediction layers' too), and the distributed optimizer's reshardable
checkpoint with more than one gradient bucket."""

from __future__ import annotations

import os

TESTED_MCORE_VERSIONS = ("0.16.1",)


ALLOW_UNTESTED = "or set SWIFT_MCORE_ALLOW_UNTESTED_MCORE=1 to try anyway."


def require_tested_version(adaptation: str, advice: str = ALLOW_UNTESTED) -> str:
    """The installed megatron-core version; raises RuntimeError naming ``adaptation`` (what
    was tested) and ``advice`` (what else to do) when it is not one of the tested ones."""
    from megatron.core import package_info

    version = package_info.__version__
    if version not in TESTED_MCORE_VERSIONS and os.environ.get(
            "SWIFT_MCORE_ALLOW_UNTESTED_MCORE") != "1":
        raise RuntimeError(
            f"swift-mcore's {adaptation} was tested with megatron-core "
            f"{', '.join(TESTED_MCORE_VERSIONS)}, but {version} is installed. Install "
            f"megatron-core=={TESTED_MCORE_VERSIONS[-1]} (requirements/base.txt), {advice}")
    return version


class ModuleProxy:
    """A look-alike of ``MODULE`` for a patched megatron module: the names a subclass
    defines replace the module's; every other name is the module's own."""

    MODULE = None

    def __getattr__(self, name):
        value = getattr(self.MODULE, name)
        setattr(self, name, value)  # later lookups are plain attribute reads
        return value


def patch_router_gemm_without_te() -> None:
    """megatron-core 0.16.1's MoE router gating (moe_utils.RouterGatingLinearFunction, 1192)
    tests ``te_general_gemm is not None``, a name its module defines only when Transformer
    Engine imports: without TE every MoE forward raises NameError. Defining the name as None
    takes megatron's own torch.mm/addmm branch, which is what it means."""
    from megatron.core.transformer.moe import moe_utils

    if not getattr(moe_utils, "HAVE_TE", False) and not hasattr(moe_utils, "te_general_gemm"):
        require_tested_version("MoE router without Transformer Engine")
        moe_utils.te_general_gemm = None


def fix_router_padding_mask() -> None:
    """Two places where megatron-core 0.16.1's router mishandles a padding mask
    (``padding_mask``: True at padding, training/moe_padding.py):

    - It counts the tokens each expert got, for the expert-bias update, with
      ``routing_map & ~padding_mask`` (router.py:542): a [tokens, experts] map and a [tokens]
      mask broadcast along the experts axis, so any mask raises (or, with as many tokens as
      experts, clears the wrong entries). The padding rows of the map are cleared instead.
    - With per-token losses it weighs each rank's load-balancing loss by the real tokens
      that rank routes (router.py:466, ``valid_token_count``). Over the TP x CP group, whose
      ranks each hold a slice of the same sequences, the slices' losses add up to one rank's
      only if each is weighed by the group's real tokens over its size, as megatron does
      without a mask (each rank's equal share); sequence and context parallelism leave the
      padding at a row's end unevenly spread. Here it is weighed so. The global
      load-balancing loss (its group spans data-parallel ranks, each with its own
      micro-batch) keeps megatron's weight."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import router
    from megatron.core.transformer.moe.router import TopKRouter

    original = TopKRouter._apply_expert_bias
    if hasattr(original, "_swift_mcore_original"):
        return
    require_tested_version("MoE router with a padding mask")
    import torch

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if padding_mask is None:
            return original(self, routing_map)
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                self.local_tokens_per_expert += (routing_map & ~padding_mask.reshape(-1, 1)).sum(0)

    _apply_expert_bias._swift_mcore_original = original
    TopKRouter._apply_expert_bias = _apply_expert_bias

    counts = router.get_tokens_per_expert_and_token_count

    def get_tokens_per_expert_and_token_count(routing_map, reduce_group, topk=None,
                                              with_padding_mask=False):
        per_expert, local, total = counts(routing_map, reduce_group, topk=topk,
                                          with_padding_mask=with_padding_mask)
        if with_padding_mask and reduce_group is \
                parallel_state.get_tensor_and_context_parallel_group(check_initialized=False):
            local = total / reduce_group.size()
        return per_expert, local, total

    router.get_tokens_per_expert_and_token_count = get_tokens_per_expert_and_token_count


def pass_padding_mask_to_mtp_layers() -> None:
    """megatron-core 0.16.1's GPTModel hands the padding mask (``padding_mask``, True at
    padding) to its decoder alone: the MTP block's forward (multi_token_prediction.py:1077)
    and each MTP layer's (861) take none, so the routers of MoE multi-token-prediction layers
    counted padding in their load-balancing loss, z-loss and expert-bias token counts. Here
    each MTP layer's transformer layer gets a mask too.

    MTP layer k (megatron's layer_number, from 1) reads at position i the decoder's hidden
    state of position i and the embedding of token i + k: megatron rolls the input ids, the
    labels and the loss mask one place left per layer, zero-filling the last place
    (roll_tensor). A position is real there only when both are: the mask of layer k is the
    real positions rolled as megatron rolls them (its roll_tensor, so over the CP ranks, and
    within conversations for packed rows, models/gpt.py), ANDed at each step, so position i
    counts iff positions i..i + k are real. An unpadded row's last k positions, whose inputs
    megatron zero-fills and whose targets lie past the row, count no more than a padded
    row's pads: the same rows padded or not route alike. Under sequence parallelism the mask
    is split over the TP ranks as the layer's hidden states are (after eh_proj); the mask
    is bound into the layer's forward function, so a recomputed layer reuses it."""
    import contextvars
    import functools

    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer import multi_token_prediction as mtp_module

    original_forward = GPTModel.forward
    if hasattr(original_forward, "_swift_mcore_original"):
        return
    require_tested_version("multi-token prediction with a padding mask")
    import torch

    padding = contextvars.ContextVar("swift_mcore_mtp_padding_mask", default=None)

    @functools.wraps(original_forward)
    def forward(self, *args, **kwargs):
        mask = kwargs.get("padding_mask")
        if mask is None or not getattr(self, "mtp_process", False):
            return original_forward(self, *args, **kwargs)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if self.config.sequence_parallel and input_ids is not None \
                and mask.shape[-1] != input_ids.shape[-1]:
            # split over the TP ranks already (a later pipeline stage: training/moe_padding)
            from megatron.core import tensor_parallel

            mask = tensor_parallel.gather_from_sequence_parallel_region(
                mask.transpose(0, 1).contiguous().to(torch.uint8),
                tensor_parallel_output_grad=False).transpose(0, 1).bool()
        token = padding.set(mask)
        try:
            return original_forward(self, *args, **kwargs)
        finally:
            padding.reset(token)

    forward._swift_mcore_original = original_forward
    GPTModel.forward = forward

    layer_class = mtp_module.MultiTokenPredictionLayer
    original_layer_forward = layer_class.forward
    original_inner = layer_class._proj_and_transformer_layer

    def mtp_layer_mask(layer, mask):
        real = (~mask).to(torch.int32)
        for _ in range(layer.layer_number):
            rolled, _ = mtp_module.roll_tensor(real, shifts=-1, dims=-1,
                                               cp_group=layer.cp_group)
            real = real * rolled
        out = real == 0
        if layer.config.sequence_parallel:
            from megatron.core import tensor_parallel

            out = tensor_parallel.scatter_to_sequence_parallel_region(
                out.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()
        return out

    def proj_and_transformer_layer(self, *args, padding_mask=None, **kwargs):
        handle = self.transformer_layer.register_forward_pre_hook(
            lambda module, a, kw: (a, {**kw, "padding_mask": padding_mask}), with_kwargs=True)
        try:
            return original_inner(self, *args, **kwargs)
        finally:
            handle.remove()

    @functools.wraps(original_layer_forward)
    def layer_forward(self, *args, **kwargs):
        mask = padding.get()
        if mask is None or kwargs.get("packed_seq_params") is not None:
            return original_layer_forward(self, *args, **kwargs)
        # megatron's forward calls (or checkpoints) self._proj_and_transformer_layer: this
        # call's is bound to this layer's mask
        self._proj_and_transformer_layer = functools.partial(
            proj_and_transformer_layer, self, padding_mask=mtp_layer_mask(self, mask))
        try:
            return original_layer_forward(self, *args, **kwargs)
        finally:
            del self._proj_and_transformer_layer

    layer_forward._swift_mcore_original = original_layer_forward
    layer_class.forward = layer_forward


def patch_mla_without_te() -> None:
    """megatron-core 0.16.1's multi-latent attention (multi_latent_attention.py, 55-66, 185)
    sets HAVE_TE when megatron's TE extension module imports, which it does without
    Transformer Engine too, with a MagicMock for TELinear: ``isinstance(x, TELinear)`` then
    raises in every MLA layer's constructor. Without TE there is no TE linear to test for,
    so HAVE_TE false is what megatron means."""
    from megatron.core.transformer import multi_latent_attention as mla

    if mla.HAVE_TE and not isinstance(mla.TELinear, type):
        require_tested_version("multi-latent attention without Transformer Engine")
        mla.HAVE_TE = False


def place_reshardable_optimizer_state_by_bucket() -> None:
    """megatron-core 0.16.1 saves the distributed optimizer's reshardable state wrong when its
    gradient buffer has more than one bucket: ``get_parameter_state_dp_zero`` lays the
    gathered state out bucket after bucket without the padding megatron puts at each
    bucket's end (distrib_optimizer.py:1117), and ``sharded_param_state_fully_reshardable``
    then cuts each parameter out of it at its offset in the padded buffer (1480), so every
    parameter after the first bucket is saved with its neighbours' values (megatron notes
    the symptom as its issue 504). While that function runs, the gathered state is put
    back at the padded offsets, where the parameters' offsets point. On any machine."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as cls

    original = cls.sharded_param_state_fully_reshardable
    if hasattr(original, "_swift_mcore_original"):
        return
    require_tested_version("distributed-optimizer checkpoint fix")

    def sharded_param_state_fully_reshardable(self, *args, **kwargs):
        gather = self.get_parameter_state_dp_zero

        def gathered_at_padded_offsets(*a, **k):
            state = gather(*a, **k)
            if state is not None:
                _pad_buckets(self, state)
            return state

        self.get_parameter_state_dp_zero = gathered_at_padded_offsets
        try:
            return original(self, *args, **kwargs)
        finally:
            del self.get_parameter_state_dp_zero

    sharded_param_state_fully_reshardable._swift_mcore_original = original
    cls.sharded_param_state_fully_reshardable = sharded_param_state_fully_reshardable


def _pad_buckets(optimizer, state) -> None:
    """Each buffer's gathered tensors (bucket after bucket, unpadded) re-laid at the buckets'
    offsets in the padded buffer, zeros in the padding."""
    import torch

    for index, buffer in enumerate(optimizer.buffers):
        for world in state[index].values():
            for key, flat in list(world.items()):
                if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
                    continue
                laid = flat.new_zeros(buffer.numel)
                start = 0
                for bucket in buffer.buckets:
                    n = bucket.numel_unpadded
                    laid[bucket.offset:bucket.offset + n] = flat[start:start + n]
                    start += n
                world[key] = laid
