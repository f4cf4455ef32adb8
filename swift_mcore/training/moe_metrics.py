"""The router's auxiliary losses of an iteration (load balancing, z-loss), as Megatron-LM
reports them: megatron's own tracker, reduced over the ranks and averaged over MoE layers.

The MoE layer adds these losses to the gradient only (MoEAuxLossAutoScaler); the loss the
trainer reports stays the LM loss, and these are logged next to it, unscaled by their
coefficients (megatron saves ``aux_loss / coeff`` in the tracker).
"""

from __future__ import annotations

from typing import Dict, List

# --moe_router_load_balancing_type -> the name megatron's router tracks its loss under
_BALANCING_NAMES = {"aux_loss": "load_balancing_loss",
                    "seq_aux_loss": "seq_load_balancing_loss",
                    "global_aux_loss": "global_load_balancing_loss"}


def loss_names(m) -> List[str]:
    """The auxiliary losses the MoE flags ``m`` make the router compute (and track)."""
    if m.num_experts is None:
        return []
    names = []
    if m.moe_aux_loss_coeff > 0 and m.moe_router_load_balancing_type in _BALANCING_NAMES:
        names.append(_BALANCING_NAMES[m.moe_router_load_balancing_type])
    if m.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names


def collect(config) -> Dict[str, float]:
    """Collective over all ranks, once per iteration: each tracked loss summed over layers
    and pipeline stages, averaged over data-parallel ranks, MoE layers and micro-batches
    (megatron's track_moe_metrics with Megatron-LM's scale), the z-loss also over TP ranks
    (a full-batch value, unlike Megatron-LM's log); the tracker is cleared."""
    names = loss_names(config.model)
    if not names:
        return {}
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics

    from ..arguments.model import moe_layer_pattern

    m = config.model
    mtp = mtp_moe_layers(m)
    if "z_loss" in names:
        _average_z_loss_over_tp_and_dp(config)
    totals: Dict = {}
    # force_initialize: a stage whose layers are all dense tracks nothing, yet joins the
    # reductions over the pipeline. The routers of MoE MTP layers track their losses after
    # the decoder's (router.py:446: num_layers + mtp_num_layers values), and count as MoE
    # layers in the average.
    track_moe_metrics(loss_scale=1.0 / config.world.num_microbatches, iteration=0,
                      total_loss_dict=totals, force_initialize=True, track_names=names,
                      num_layers=m.num_layers + (m.mtp_num_layers or 0),
                      moe_layer_freq=moe_layer_pattern(m), mtp_num_layers=mtp or None)
    return {name: float(totals[name]) for name in names}


def mtp_moe_layers(m) -> int:
    """The multi-token prediction layers that are MoE layers (each is built like the
    decoder's last layer: models/gpt.py mtp_block_spec)."""
    if not m.mtp_num_layers or m.num_experts is None:
        return 0
    from ..arguments.model import moe_layer_pattern

    return m.mtp_num_layers if moe_layer_pattern(m)[-1] else 0


def _average_z_loss_over_tp_and_dp(config) -> None:
    """megatron tracks the z-loss without a reduction group (router.py:505): each rank logs
    the mean over its own tokens, which at TP > 1 (a sequence slice) or DP > 1 is a part of
    the batch. Averaged over the TP and DP ranks (equal token counts) it is the mean over
    the global batch, as on one rank. The load-balancing loss is already summed over TP
    and averaged over DP by megatron (router.py:310)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    if "z_loss" not in tracker:  # a stage without MoE layers: zeros, as force_initialize
        tracker["z_loss"] = {
            "values": torch.zeros(config.model.num_layers + (config.model.mtp_num_layers or 0),
                                  device="cuda" if config.cuda else "cpu"),
            "reduce_group": None, "reduce_group_has_dp": False}
    tracker["z_loss"]["avg_group"] = parallel_state.get_tensor_and_data_parallel_group(
        with_context_parallel=True)


def reset() -> None:
    """Forgets what megatron keeps for the whole process about the router's losses, so that
    each Trainer starts afresh after an earlier run, test or a user's own loop in the process:

    * the aux-loss gradient scale (MoEAuxLossAutoScaler.main_loss_backward_scale,
      moe_utils.py:267-286): a backward outside megatron's schedule leaves it a 0-dim tensor,
      and the schedule's later ``copy_`` of its [1]-shaped scale into it raises "output with
      shape [] doesn't match the broadcast shape [1]"; unset, the schedule stores its own;
    * the layer-wise loss tracker (moe_utils.py:880): its per-layer tensors keep the layer
      count of the model that first tracked (a model with more layers then fails with an
      IndexError), and losses tracked but never collected (a forward outside the Trainer)
      would be added to this run's first iteration."""
    from megatron.core.transformer.moe.moe_utils import (
        MoEAuxLossAutoScaler, get_moe_layer_wise_logging_tracker)

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    get_moe_layer_wise_logging_tracker().clear()
