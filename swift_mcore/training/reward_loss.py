"""A reward model's loss, TRL 1.16's RewardTrainer's: Bradley-Terry on each pair's scores,
-logsigmoid(r_chosen - r_rejected - margin), plus --center_rewards_coefficient times
(r_chosen + r_rejected)^2; and the metrics it logs.

Per pair: the trainer sums over a micro-batch's pairs and megatron divides by the global
batch's pair count, so the loss is TRL's batch mean (its centering term is a mean over
pairs too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RewardLoss:
    center_rewards_coefficient: Optional[float] = None

    @classmethod
    def from_config(cls, r) -> "RewardLoss":
        return cls(r.center_rewards_coefficient)

    def __call__(self, chosen: torch.Tensor, rejected: torch.Tensor,
                 margin: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Per pair [B], from the scores of the chosen and the rejected sequences [B] and
        the rows' margins [B] (None: 0)."""
        delta = chosen - rejected
        if margin is not None:
            delta = delta - margin.to(delta)
        loss = -F.logsigmoid(delta)
        if self.center_rewards_coefficient is not None:
            loss = loss + self.center_rewards_coefficient * (chosen + rejected) ** 2
        return loss


# Means over the pairs: DPO's names (ms-swift's for a reward model) and TRL's
# RewardTrainer's (accuracy, margin, mean_reward); min_reward and max_reward beside them.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "accuracy", "margin", "mean_reward")
EXTREMES = ("min_reward", "max_reward")


def reward_sums(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Per-micro-batch sums for METRICS (detached); each is divided by the pair count."""
    chosen, rejected = chosen.detach().float(), rejected.detach().float()
    correct = (chosen > rejected).float().sum()
    margins = (chosen - rejected).sum()
    return torch.stack([chosen.sum(), rejected.sum(), correct, margins, correct, margins,
                        (chosen.sum() + rejected.sum()) / 2])


def reward_extremes(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """[-min, max] of the micro-batch's scores (a MAX reduction gives both)."""
    scores = torch.cat([chosen, rejected]).detach().float()
    return torch.stack([-scores.min(), scores.max()])
