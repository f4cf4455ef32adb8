"""TRL 1.16's KTO losses, per row, from sequence log-probabilities and the batch's KL
estimate: kto, and apo_zero_unpaired (the unpaired APO-zero loss, which has no KL term).

The KL estimate is TRL's: the mean over a micro-batch of the policy's minus the reference's
log-probability of mismatched rows (each prompt with another row's completion), averaged
over the data-parallel ranks, detached and clamped at 0. The trainer sums the rows' losses
and megatron divides by the global batch's row count: TRL's mean when a micro-batch is the
whole batch (docs/rlhf.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
           "logps/rejected", "kl")


@dataclass(frozen=True)
class KtoLoss:
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    loss_type: str = "kto"

    @classmethod
    def from_config(cls, r) -> "KtoLoss":
        return cls(r.beta, r.desirable_weight, r.undesirable_weight, r.kto_loss_type())

    @property
    def uses_kl(self) -> bool:
        """Whether the loss reads the KL estimate (and the KL rows are run at all)."""
        return self.loss_type == "kto"

    def __call__(self, logps, ref_logps, desirable, kl) -> Dict[str, torch.Tensor]:
        """Per row: ``loss`` (weighted) and ``rewards`` (beta times the policy's minus the
        reference's log-probability, detached). ``logps``, ``ref_logps``: summed
        log-probabilities of each completion [B]; ``desirable``: bool [B]; ``kl``: the
        clamped KL estimate (a detached scalar)."""
        ratio = logps - ref_logps
        weight = torch.where(desirable, torch.full_like(ratio, self.desirable_weight),
                             torch.full_like(ratio, self.undesirable_weight))
        if self.loss_type == "apo_zero_unpaired":
            # the APO paper's APO-zero, unpaired: push desirable answers' log-ratios up and
            # undesirable ones' down, each from zero (no KL reference point); kto's with the
            # KL at 0, written as TRL writes it
            loss = weight * torch.where(desirable, 1 - torch.sigmoid(self.beta * ratio),
                                        torch.sigmoid(self.beta * ratio))
        else:
            # Eq. (7) of the KTO paper: a desirable answer's value rises with its log-ratio
            # above the KL, an undesirable one's with its log-ratio below it
            value = torch.where(desirable, ratio - kl, kl - ratio)
            loss = weight * (1 - torch.sigmoid(self.beta * value))
        return {"loss": loss, "rewards": self.beta * ratio.detach()}


def kl_estimate(kl_logps, ref_kl_logps) -> torch.Tensor:
    """This micro-batch's share of the KL estimate (before the mean over ranks and the
    clamp): the mean of the mismatched rows' log-ratios, detached."""
    return (kl_logps - ref_kl_logps).mean().detach()


def metric_sums(logps, rewards, desirable, kl) -> torch.Tensor:
    """Per micro-batch sums for TRL's KTO metrics: desirable rewards, their count,
    undesirable rewards, their count, desirable logps, undesirable logps, kl (detached)."""
    logps = logps.detach()
    d = desirable.to(logps.dtype)
    u = 1 - d
    return torch.stack([(rewards * d).sum(), d.sum(), (rewards * u).sum(), u.sum(),
                        (logps * d).sum(), (logps * u).sum(), kl.reshape(())])


def metrics_from_sums(sums, micro_batches: float) -> Dict[str, float]:
    """TRL's metric values from ``metric_sums`` summed over a global batch (of
    ``micro_batches`` micro-batches on all ranks): a class absent from the batch has none,
    and the margin needs both."""
    chosen_r, chosen_n, rejected_r, rejected_n, chosen_l, rejected_l, kl = sums
    out = {"kl": kl / max(micro_batches, 1.0)}
    if chosen_n > 0:
        out["rewards/chosen"] = chosen_r / chosen_n
        out["logps/chosen"] = chosen_l / chosen_n
    if rejected_n > 0:
        out["rewards/rejected"] = rejected_r / rejected_n
        out["logps/rejected"] = rejected_l / rejected_n
    if chosen_n > 0 and rejected_n > 0:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out
