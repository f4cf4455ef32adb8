"""The `swift-mcore rlhf --rlhf_type kto` Trainer: KTO on unpaired rows, DPO's Trainer with
TRL's KL estimate, loss and metrics.

Each micro-batch runs its rows through the policy (with autograd) and the reference, and
its KL rows (each prompt with another row's completion) through both without autograd; the
reference is DPO's (a frozen copy, --ref_model, or the LoRA base with adapters off).
"""

from __future__ import annotations

from functools import partial
from typing import Dict

import torch

from ..runtime import collectives
from .kto_loss import METRICS, KtoLoss, kl_estimate, metric_sums, metrics_from_sums
from .moe_padding import routing_padding
from .rlhf_trainer import (DpoTrainer, first_cp_rank, is_last_stage, over_cp,
                           reference_identity, sequence_sums, set_stage_input, stage_input)


def _sequence_logps(per_token_losses, batch, prefix: str = "") -> torch.Tensor:
    """Each row's log-probability of its completion (a packed row's sequences apart), summed
    over the context-parallel ranks' parts of the row."""
    mask = batch[prefix + "loss_mask"].float()
    return over_cp(sequence_sums(-(per_token_losses.float() * mask), batch,
                                 count=batch["desirable"].numel(), prefix=prefix))


class KtoTrainer(DpoTrainer):
    """``KtoTrainer(RlhfArguments...).train()`` with ``--rlhf_type kto``."""

    METRIC_NAMES = METRICS

    def __init__(self, args):
        super().__init__(args)
        self.kto = KtoLoss.from_config(self.config.rlhf)

    def describe_loss(self) -> str:
        return (f"{self.kto.loss_type} (desirable_weight {self.kto.desirable_weight}, undesirable_weight "
                f"{self.kto.undesirable_weight})")

    # ---- data -------------------------------------------------------------------------
    def fingerprint_data(self) -> str:
        """As DPO's: the data's identity with the reference's after it."""
        from ..checkpointing.compat import with_reference
        from ..data.unpaired import unpaired_fingerprint
        from .rlhf_trainer import check_reference_folder

        if self.config.rlhf.ref_model:  # before anything is read or built
            check_reference_folder(self.config, self.tokenizer)
        return with_reference(unpaired_fingerprint(self.config, self.tokenizer),
                              reference_identity(self.config))

    def build_datasets(self):
        from ..data.unpaired import build_unpaired_datasets

        return build_unpaired_datasets(self.config, self.tokenizer,
                                       log=self.writer_print_early)

    # ---- one micro-batch --------------------------------------------------------------
    # Under pipeline parallelism a stage receives, side by side on the batch axis, the
    # policy's rows, the reference's, and (a loss with a KL term) the reference's KL rows and
    # the policy's KL rows, and passes them on so; the last stage's loss reads those it
    # holds without autograd.
    def forward_step(self, data_iterator, model):
        batch = self.micro_batch(data_iterator)
        received = stage_input(model)
        rows = batch["tokens"].shape[0]

        def inputs(prefix):
            return dict(input_ids=batch[prefix + "tokens"],
                        position_ids=batch[prefix + "position_ids"],
                        attention_mask=batch.get(prefix + "attention_mask"),
                        labels=batch[prefix + "labels"])

        def stream(chunk, number):
            if received is not None:
                set_stage_input(chunk, received[:, number * rows:(number + 1) * rows])
            return chunk

        with torch.no_grad():
            # the KL rows only estimate a constant of the loss: no autograd for them
            with self.reference_of(model) as reference:
                ref = stream(reference, 1)(**inputs(""))
                if self.kto.uses_kl:
                    ref_kl = stream(reference, 2)(**inputs("kl_"))
            if self.kto.uses_kl:
                kl = stream(model, 3)(**inputs("kl_"))
        # (the KL rows and the reference run without autograd, which the routers skip)
        output = stream(model, 0)(**inputs(""), **routing_padding(self.config, model, batch))
        if not is_last_stage(model):
            sent = [output, ref, ref_kl, kl] if self.kto.uses_kl else [output, ref]
            return torch.cat(sent, dim=1), partial(self.compute_loss, batch)
        batch["ref_logps"] = _sequence_logps(ref, batch)
        if self.kto.uses_kl:
            batch["ref_kl_logps"] = _sequence_logps(ref_kl, batch, "kl_")
            batch["kl_logps"] = _sequence_logps(kl, batch, "kl_")
        return output, partial(self.compute_loss, batch)

    def rows_per_micro_batch(self) -> int:
        rows = self.config.training.micro_batch_size
        if self.config.world.pipeline_parallel == 1:
            return rows
        return rows * (4 if self.kto.uses_kl else 2)

    def batch_kl(self, batch) -> torch.Tensor:
        """TRL's KL estimate: this micro-batch's mean, averaged over the data-parallel ranks
        (each runs the same number of micro-batches), clamped at 0; 0 for a loss without a
        KL term (TRL logs 0 then)."""
        from megatron.core import parallel_state

        if "kl_logps" not in batch:
            return torch.zeros((), device=batch["ref_logps"].device)

        kl = kl_estimate(batch["kl_logps"], batch["ref_kl_logps"])
        group = parallel_state.get_data_parallel_group()
        ranks = parallel_state.get_data_parallel_world_size()
        if ranks > 1:
            kl = collectives.all_reduce(kl.clone(), group=group).to(kl.device) / ranks
        return kl.clamp(min=0)

    def compute_loss(self, batch, output_tensor):
        """(sum of the rows' losses, row count, report): megatron divides the gradients by
        the global batch's rows, so the loss is the mean over rows, as TRL's."""
        logps = _sequence_logps(output_tensor, batch)
        kl = self.batch_kl(batch)
        desirable = batch["desirable"].to(logps.device).bool()
        out = self.kto(logps, batch["ref_logps"], desirable, kl)
        loss_sum = out["loss"].sum()
        rows = logps.shape[0]
        tokens = torch.as_tensor(batch.get("num_tokens", batch["tokens"].numel()),
                                 dtype=torch.float, device=logps.device)
        report = {"lm loss": torch.stack([loss_sum.detach(),
                                          torch.tensor(float(rows), device=logps.device),
                                          tokens]),
                  "rlhf": metric_sums(logps, out["rewards"], desirable, kl)}
        # every CP rank holds the whole loss (over_cp), each differentiating through its own
        # tokens; megatron sums the counts over DP x CP: one rank of the group counts the rows
        counted = rows if first_cp_rank() else 0
        return loss_sum, torch.tensor(counted, dtype=torch.int, device=logps.device), report

    # ---- metrics ----------------------------------------------------------------------
    def preference_metrics(self, losses) -> Dict[str, float]:
        """TRL's KTO metrics over the global batch, on the last pipeline stage."""
        from megatron.core import parallel_state

        if not losses or not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            return {}
        sums = torch.stack([e["rlhf"] for e in losses]).sum(0)
        sums = torch.cat([sums, sums.new_tensor([float(len(losses))])])
        sums = collectives.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        values = sums.tolist()
        return metrics_from_sums(values[:-1], values[-1])
