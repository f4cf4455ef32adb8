"""The multi-token prediction loss of an iteration (--mtp_num_layers), as Megatron-LM reports
it: megatron's own tracker (MTPLossLoggingHelper), averaged over the data-parallel ranks and
the micro-batches.

The MTP block adds its loss to the gradient only (MTPLossAutoScaler, times
--mtp_loss_scaling_factor over the layer count); the loss the trainer reports stays the LM
loss, and this one is logged next to it, unscaled: ``mtp_loss`` is the mean over the MTP
layers of each layer's cross entropy, per token of its micro-batch (the targets k + 1
places ahead, the last k + 1 positions of a row left out); with several layers each one's
is also logged as ``mtp_<k>_loss``.
"""

from __future__ import annotations

from typing import Dict


def reset() -> None:
    """Forgets what megatron's tracker holds for the whole process (a class attribute): an
    earlier model's values (another layer count, another run in this process) must not
    join this run's first iteration."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()


def collect(config) -> Dict[str, float]:
    """Collective over the data-parallel ranks of the last pipeline stage (where megatron
    builds the MTP block), once per training iteration; the tracker is cleared. Empty
    without --mtp_num_layers and on the other stages."""
    layers = config.model.mtp_num_layers
    if not layers:
        return {}
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    if "values" not in tracker:  # no training forward since the last collect
        return {}
    MTPLossLoggingHelper.reduce_loss_in_tracker()
    per_layer = [float(v) / config.world.num_microbatches for v in tracker["values"]]
    MTPLossLoggingHelper.clean_loss_in_tracker()
    out = {"mtp_loss": sum(per_layer) / layers}
    if layers > 1:
        out.update({f"mtp_{k + 1}_loss": value for k, value in enumerate(per_layer)})
    return out


def is_mtp_loss(key: str) -> bool:
    """Whether a metric name is one collect() gives."""
    return key.startswith("mtp_") and key.endswith("_loss")
