"""TRL 1.16's reference-free preference losses per pair: ORPO (its ORPOTrainer) and SimPO
(its CPOTrainer with loss_type "simpo"), from length-averaged log-probabilities.

Both average each answer's log-probability over its tokens, as TRL does for them. The NLL
term is a mean over the chosen rows' tokens of a micro-batch (for ORPO all their tokens,
prompt included; for SimPO the answers'), so it equals TRL's when a micro-batch is the
whole batch, as DPO's 'sft' (docs/rlhf.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict

import torch
import torch.nn.functional as F

from .dpo_loss import METRICS

ORPO_METRICS = (*METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen")
SIMPO_METRICS = (*METRICS, "nll_loss")

_LOG_HALF = -math.log(2.0)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0 without cancellation: log1p(-exp(x)) far below 0,
    log(-expm1(x)) near it. Each branch reads a clamped input, so the branch not taken
    never yields inf or nan (which would poison the gradient through torch.where)."""
    far = x < _LOG_HALF
    low = torch.log1p(-torch.exp(torch.where(far, x, torch.full_like(x, _LOG_HALF))))
    near = torch.log(-torch.expm1(torch.where(far, torch.full_like(x, _LOG_HALF), x)))
    return torch.where(far, low, near)


@dataclass(frozen=True)
class OrpoLoss:
    """ORPO: the chosen rows' NLL minus beta times log sigmoid of the log odds ratio."""
    beta: float = 0.1

    @classmethod
    def from_config(cls, r) -> "OrpoLoss":
        return cls(r.beta)

    def __call__(self, chosen_logps, rejected_logps, nll) -> Dict[str, torch.Tensor]:
        """Per pair: ``loss``, ``log_odds_ratio`` (log sigmoid of the log odds) and
        ``log_odds`` (both detached). ``*_logps``: each answer's mean log-probability per
        token [B]; ``nll``: the micro-batch's NLL of the chosen rows (a scalar)."""
        chosen, rejected = chosen_logps.float(), rejected_logps.float()
        # the odds of an answer are p / (1 - p), with log p its mean log-probability
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        return {"loss": nll - self.beta * ratio, "log_odds_ratio": ratio.detach(),
                "log_odds": log_odds.detach()}


@dataclass(frozen=True)
class SimpoLoss:
    """SimPO: a sigmoid loss on the difference of mean log-probabilities less a margin
    gamma / beta, with TRL's label smoothing and cpo_alpha times the chosen answers' NLL."""
    beta: float = 0.1
    gamma: float = 0.5
    label_smoothing: float = 0.0
    cpo_alpha: float = 0.0

    @classmethod
    def from_config(cls, r) -> "SimpoLoss":
        return cls(r.beta, r.simpo_gamma, r.label_smoothing, r.cpo_alpha)

    def __call__(self, chosen_logps, rejected_logps, nll) -> Dict[str, torch.Tensor]:
        """Per pair: ``loss``. Arguments as OrpoLoss's (``nll`` over the answers only)."""
        logits = self.beta * (chosen_logps - rejected_logps - self.gamma / self.beta)
        eps = self.label_smoothing
        loss = -F.logsigmoid(logits) * (1 - eps) - F.logsigmoid(-logits) * eps
        return {"loss": loss + self.cpo_alpha * nll}
