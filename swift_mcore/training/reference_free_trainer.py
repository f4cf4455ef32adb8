"""The `swift-mcore rlhf --rlhf_type orpo|simpo` Trainer: TRL's ORPO and SimPO on preference
pairs, DPO's Trainer (data, order, checkpoints, export) without a reference model.

Each answer's log-probability is its mean per token; nothing but the policy is built, so a
step is one forward and backward of the pairs' chosen and rejected rows.
"""

from __future__ import annotations

from functools import partial
from typing import Dict

import torch

from ..runtime import collectives
from .dpo_loss import reward_metrics
from .moe_padding import routing_padding
from .reference_free_loss import ORPO_METRICS, SIMPO_METRICS, OrpoLoss, SimpoLoss
from .rlhf_trainer import DpoTrainer, first_cp_rank, over_cp, sequence_sums
from .trainer import Trainer


class ReferenceFreeTrainer(DpoTrainer):
    """``ReferenceFreeTrainer(RlhfArguments...).train()`` with ``--rlhf_type orpo|simpo``."""

    def __init__(self, args):
        super().__init__(args)
        r = self.config.rlhf
        self.orpo = r.rlhf_type == "orpo"
        self.loss = OrpoLoss.from_config(r) if self.orpo else SimpoLoss.from_config(r)
        self.METRIC_NAMES = ORPO_METRICS if self.orpo else SIMPO_METRICS

    def describe_loss(self) -> str:
        r = self.config.rlhf
        if self.orpo:
            return "orpo (odds ratio + NLL of the chosen rows)"
        return (f"simpo (gamma {r.simpo_gamma}, label_smoothing {r.label_smoothing}, "
                f"cpo_alpha {r.cpo_alpha})")

    def build_model(self) -> list:
        chunks = Trainer.build_model(self)  # the policy only: no reference to build
        r = self.config.rlhf
        self.writer_print_early(f"rlhf {r.rlhf_type}: reference model: none (reference-free);"
                                f" loss {self.describe_loss()}, beta {r.beta}")
        return chunks

    # ---- one micro-batch --------------------------------------------------------------
    def forward_step(self, data_iterator, model):
        batch = self.micro_batch(data_iterator)
        output = model(input_ids=batch["tokens"], position_ids=batch["position_ids"],
                       attention_mask=batch.get("attention_mask"), labels=batch["labels"],
                       **routing_padding(self.config, model, batch))
        return output, partial(self.compute_loss, batch)

    def chosen_nll(self, losses, batch, pairs) -> torch.Tensor:
        """The chosen rows' NLL, a mean over their tokens in this micro-batch: ORPO's over
        every position (prompt included), SimPO's over the answers (0 without
        --cpo_alpha, as TRL reports it)."""
        if self.orpo:
            mask = batch["sequence_mask"].float()
        elif self.loss.cpo_alpha == 0:
            return losses.new_zeros(())
        else:
            mask = batch["loss_mask"].float()
        segments = batch.get("segment_ids")
        if segments is None:
            mask, losses = mask[:pairs], losses[:pairs]
        else:  # --packing: chosen i is sequence i
            mask = mask * ((segments >= 0) & (segments < pairs))
        return over_cp((losses.float() * mask).sum()) / over_cp(mask.sum()).clamp(min=1.0)

    def compute_loss(self, batch, output_tensor):
        """(sum of the pairs' losses, pair count, report): megatron divides the gradients by
        the global batch's pairs, so the loss is the mean over pairs, as TRL's."""
        mask = batch["loss_mask"].float()
        # sums over the context-parallel ranks' parts of each row (over_cp), then the mean
        logps = (over_cp(sequence_sums(-(output_tensor.float() * mask), batch))
                 / over_cp(sequence_sums(mask, batch)).clamp(min=1.0))
        pairs = logps.shape[0] // 2
        nll = self.chosen_nll(output_tensor, batch, pairs)
        out = self.loss(logps[:pairs], logps[pairs:], nll)
        loss_sum = out["loss"].sum()
        tokens = torch.as_tensor(batch.get("num_tokens", batch["tokens"].numel()),
                                 dtype=torch.float, device=logps.device)
        count = torch.tensor(float(pairs), device=logps.device)
        zeros = torch.zeros_like(logps[:pairs])
        sums = [reward_metrics(self.loss.beta, logps[:pairs], logps[pairs:], zeros, zeros),
                (nll.detach() * pairs).reshape(1)]
        if self.orpo:
            sums.append(torch.stack([out["log_odds_ratio"].sum(), out["log_odds"].sum()]))
        report = {"lm loss": torch.stack([loss_sum.detach(), count, tokens]),
                  "rlhf": torch.cat(sums)}
        # every CP rank holds the whole loss; one rank of the group counts the pairs
        counted = pairs if first_cp_rank() else 0
        return loss_sum, torch.tensor(counted, dtype=torch.int, device=logps.device), report

    # ---- metrics ----------------------------------------------------------------------
    def preference_metrics(self, losses) -> Dict[str, float]:
        """TRL's metrics (means over the global batch's pairs), on the last pipeline stage."""
        from megatron.core import parallel_state

        if not losses or not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            return {}
        sums = torch.stack([torch.cat([e["rlhf"], e["lm loss"][1:2]]) for e in losses]).sum(0)
        sums = collectives.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        values = sums.tolist()
        pairs = max(values[-1], 1.0)
        return {name: v / pairs for name, v in zip(self.METRIC_NAMES, values)}
