"""The DPO losses of TRL 1.16 (each --loss_type), per pair, from sequence log-probabilities.

The trainer sums what this returns over a micro-batch's pairs and megatron divides by the
global batch's pair count, so the loss is TRL's batch mean. 'aot' and 'aot_unpaired' sort
within a micro-batch, and 'sft' averages over its chosen tokens: they equal TRL's when a
micro-batch is the whole batch (docs/rlhf.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DpoLoss:
    loss_types: Sequence[str]
    loss_weights: Sequence[float]
    beta: float = 0.1
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05

    @classmethod
    def from_config(cls, r) -> "DpoLoss":
        """From the rlhf flags: --rpo_alpha is TRL 1.16's 'sft' loss with that weight."""
        types: List[str] = list(r.loss_type)
        weights = list(r.loss_weights) if r.loss_weights else [1.0] * len(types)
        if r.rpo_alpha is not None:
            types.append("sft")
            weights.append(float(r.rpo_alpha))
        return cls(tuple(types), tuple(weights), r.beta, r.label_smoothing, r.discopop_tau)

    def __call__(self, chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                 chosen_lengths, rejected_lengths, chosen_tokens) -> Dict[str, torch.Tensor]:
        """Per pair: ``loss`` (the weighted sum over the loss types) and ``nll`` (the 'sft'
        part, unweighted). ``*_logps``: summed log-probabilities of each answer [B];
        ``*_lengths``: its token counts as TRL's completion mask counts them [B];
        ``chosen_tokens``: the chosen answers' trained tokens (the 'sft' mean's divisor)."""
        beta, eps = self.beta, self.label_smoothing
        chosen_ratio = chosen_logps - ref_chosen_logps
        rejected_ratio = rejected_logps - ref_rejected_logps
        delta = chosen_ratio - rejected_ratio
        total = torch.zeros_like(chosen_logps)
        nll = torch.zeros_like(chosen_logps)
        for kind, weight in zip(self.loss_types, self.loss_weights):
            if kind == "sigmoid":
                loss = -F.logsigmoid(beta * delta)
            elif kind == "hinge":
                loss = torch.relu(1 - beta * delta)
            elif kind == "ipo":
                # length-normalized, as TRL (and the IPO authors) compute it
                avg = (chosen_ratio / chosen_lengths.clamp(min=1.0)
                       - rejected_ratio / rejected_lengths.clamp(min=1.0))
                loss = (avg - 1 / (2 * beta)) ** 2
            elif kind == "exo_pair":
                eps_t = torch.tensor(eps, dtype=delta.dtype, device=delta.device)
                loss = (torch.sigmoid(beta * delta) * (F.logsigmoid(beta * delta)
                                                       - torch.log1p(-eps_t))
                        + torch.sigmoid(-beta * delta) * (F.logsigmoid(-beta * delta)
                                                          - torch.log(eps_t)))
            elif kind == "nca_pair":
                loss = (-F.logsigmoid(beta * chosen_ratio)
                        - 0.5 * F.logsigmoid(-beta * chosen_ratio)
                        - 0.5 * F.logsigmoid(-beta * rejected_ratio))
            elif kind == "robust":
                loss = (-(1 - eps) * F.logsigmoid(beta * delta)
                        + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
            elif kind == "bco_pair":
                loss = -F.logsigmoid(beta * chosen_ratio) - F.logsigmoid(-beta * rejected_ratio)
            elif kind == "sppo_hard":
                loss = (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
            elif kind in ("aot", "aot_unpaired"):
                if kind == "aot":
                    a = torch.sort(chosen_logps - rejected_logps, dim=0)[0]
                    b = torch.sort(ref_chosen_logps - ref_rejected_logps, dim=0)[0]
                else:
                    a = torch.sort(chosen_ratio, dim=0)[0]
                    b = torch.sort(rejected_ratio, dim=0)[0]
                d = a - b
                loss = -F.logsigmoid(beta * d) * (1 - eps) - F.logsigmoid(-beta * d) * eps
            elif kind == "apo_zero":
                loss = (1 - torch.sigmoid(beta * chosen_ratio)) + torch.sigmoid(
                    beta * rejected_ratio)
            elif kind == "apo_down":
                loss = torch.sigmoid(beta * chosen_ratio) + (1 - torch.sigmoid(beta * delta))
            elif kind == "discopop":
                logits = beta * delta
                mix = torch.sigmoid(logits / self.discopop_tau)
                # exp(-logits) * mix as one exponent: TRL's product is inf * 0 = nan once
                # logits < -88 (float32's exp overflows) where the term tends to 0
                exp_mix = torch.exp(F.logsigmoid(logits / self.discopop_tau) - logits)
                loss = -F.logsigmoid(logits) * (1 - mix) + exp_mix
            elif kind == "sft":
                mean_nll = -chosen_logps.sum() / chosen_tokens.clamp(min=1.0)
                loss = mean_nll.expand_as(chosen_logps)
                nll = loss
            elif kind == "sigmoid_norm":
                avg = (chosen_ratio / chosen_lengths.clamp(min=1.0)
                       - rejected_ratio / rejected_lengths.clamp(min=1.0))
                loss = -F.logsigmoid(beta * avg)
            else:
                raise ValueError(f"unknown DPO loss type {kind!r}")
            total = total + weight * loss
        return {"loss": total, "nll": nll}


def reward_metrics(beta: float, chosen_logps, rejected_logps, ref_chosen_logps,
                   ref_rejected_logps) -> torch.Tensor:
    """Per-pair sums for TRL's metrics, in METRICS order (detached)."""
    chosen = beta * (chosen_logps - ref_chosen_logps).detach()
    rejected = beta * (rejected_logps - ref_rejected_logps).detach()
    return torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).float().sum(),
                        (chosen - rejected).sum(), chosen_logps.detach().sum(),
                        rejected_logps.detach().sum()])


METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")
