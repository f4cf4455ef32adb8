"""The `swift-mcore rlhf --rlhf_type rm` Trainer: a reward model (a causal LM with a score
head, or a *ForSequenceClassification folder) trained on preference pairs with TRL's
Bradley-Terry loss, on the base Trainer's loop, data order, checkpoints and export.

The score of a sequence is the head's output at its last non-pad token
(models/value_head.py), as transformers' *ForSequenceClassification reads it. There is no
reference model. With --tuner_type lora the score head trains whole beside the adapters
(as peft's modules_to_save).
"""

from __future__ import annotations

from functools import partial
from typing import Dict

import torch

from ..runtime import collectives
from .moe_padding import routing_padding
from .reward_loss import EXTREMES, METRICS, RewardLoss, reward_extremes, reward_sums
from .rlhf_trainer import DpoTrainer, first_cp_rank, over_cp
from .trainer import Trainer


class RewardTrainer(DpoTrainer):
    """``RewardTrainer(RlhfArguments...).train()`` for --rlhf_type rm."""

    METRIC_NAMES = (*METRICS, *EXTREMES)

    def __init__(self, args):
        super().__init__(args)
        self.reward_loss = RewardLoss.from_config(self.config.rlhf)
        self.pad_id = None  # the tokenizer's pad token, once the data is built

    # ---- data -------------------------------------------------------------------------
    def fingerprint_data(self) -> str:
        from ..data.reward_pairs import reward_fingerprint

        return reward_fingerprint(self.config, self.tokenizer)

    def build_datasets(self):
        from ..data.reward_pairs import build_reward_datasets

        train, valid, test = build_reward_datasets(self.config, self.tokenizer,
                                                   log=self.writer_print_early)
        self.pad_id = train.pad_id
        return train, valid, test

    # ---- the model --------------------------------------------------------------------
    def build_model(self) -> list:
        from ..models.value_head import is_score_config

        chunks = Trainer.build_model(self)  # no reference: a reward model has none
        m = self.config.model
        folder = None
        if m.model:
            from ..models.hf_folder import HFFolder

            folder = HFFolder(m.model, flag="--model").config
        head = ("--model's score.weight" if folder is not None and is_score_config(folder)
                else f"new, drawn from normal(0, {m.init_method_std}) with --seed "
                     f"{self.config.training.seed}")
        self.writer_print_early(f"rlhf rm: a reward model; score head [{m.num_labels}, "
                                f"{m.hidden_size}]: {head}")
        return chunks

    # ---- one micro-batch --------------------------------------------------------------
    def forward_step(self, data_iterator, model):
        batch = self.micro_batch(data_iterator)
        output = model(input_ids=batch["tokens"], position_ids=batch["position_ids"],
                       attention_mask=batch.get("attention_mask"),
                       **routing_padding(self.config, model, batch))
        return output, partial(self.compute_loss, batch)

    def rewards(self, batch, output_tensor) -> torch.Tensor:
        """Each sequence's score [2B] at its last non-pad token (a packed row's sequences
        each at theirs: ``score_index``)."""
        from ..models.value_head import pooled

        if "score_index" in batch:
            where = batch["score_index"].to(output_tensor.device)
            if self.config.world.context_parallel > 1:
                return packed_scores_over_cp(output_tensor.float(), where)
            return output_tensor[where[:, 0], where[:, 1], 0].float()
        pad = self.pad_id if self.pad_id is not None else self.train_ds.pad_id
        if self.config.world.context_parallel > 1:
            return scores_over_cp(output_tensor.float(), batch["tokens"], pad)
        return pooled(output_tensor.float(), batch["tokens"], pad)[:, 0]

    def compute_loss(self, batch, output_tensor):
        """(sum of the pairs' losses, pair count, report): the loss is the mean over the
        global batch's pairs, as TRL's."""
        rewards = self.rewards(batch, output_tensor)
        pairs = rewards.shape[0] // 2
        chosen, rejected = rewards[:pairs], rewards[pairs:]
        margin = batch.get("margin") if self.train_ds.has_margin else None
        loss_sum = self.reward_loss(chosen, rejected, margin).sum()
        tokens = torch.as_tensor(batch.get("num_tokens", batch["tokens"].numel()),
                                 dtype=torch.float, device=rewards.device)
        count = torch.tensor(float(pairs), device=rewards.device)
        report = {"lm loss": torch.stack([loss_sum.detach(), count, tokens]),
                  "rlhf": reward_sums(chosen, rejected),
                  "extremes": reward_extremes(chosen, rejected)}
        # every CP rank holds the whole loss (over_cp); one rank of the group counts the pairs
        counted = pairs if first_cp_rank() else 0
        return loss_sum, torch.tensor(counted, dtype=torch.int, device=rewards.device), report

    # ---- metrics ----------------------------------------------------------------------
    def preference_metrics(self, losses) -> Dict[str, float]:
        """Means over the global batch's pairs (TRL's), with the lowest and highest score."""
        from megatron.core import parallel_state

        if not losses or not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            return {}
        group = parallel_state.get_data_parallel_group()
        sums = torch.stack([torch.cat([e["rlhf"], e["lm loss"][1:2]]) for e in losses]).sum(0)
        sums = collectives.all_reduce(sums, group=group).tolist()
        extremes = torch.stack([e["extremes"] for e in losses]).max(0).values
        extremes = collectives.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX,
                                          group=group).tolist()
        pairs = max(sums[-1], 1.0)
        metrics = {name: v / pairs for name, v in zip(METRICS, sums)}
        metrics.update(min_reward=-extremes[0], max_reward=extremes[1])
        return metrics


def _cp_positions(local_width: int, group, device) -> torch.Tensor:
    """The whole row's positions this context-parallel rank holds ([local_width]), cut as
    megatron cut the row (its rank in the group: parallel_state's)."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    whole = torch.arange(local_width * group.size(), device=device)[None]
    return get_batch_on_this_cp_rank({"tokens": whole})["tokens"][0]


def packed_scores_over_cp(scores: torch.Tensor, score_index: torch.Tensor) -> torch.Tensor:
    """Each packed sequence's score [2B] when the context-parallel ranks hold two of the
    2 x CP chunks of every row (``scores`` [rows, s/CP, 1]; ``score_index`` [2B, 2]: each
    sequence's row and position in the whole row): the rank that holds that position gives
    its score, the others 0, summed over the group (over_cp: its gradient reaches that
    rank's token only)."""
    from megatron.core import parallel_state

    group = parallel_state.get_context_parallel_group()
    where = _cp_positions(scores.shape[1], group, scores.device)
    here = (where[None, :] == score_index[:, 1:2]).to(scores.dtype)  # [2B, s/CP]
    return over_cp((scores[score_index[:, 0], :, 0] * here).sum(-1))


def scores_over_cp(scores: torch.Tensor, tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Each row's score [B] at its last non-pad token when the context-parallel ranks hold
    two of the 2 x CP chunks of every row (``scores`` [B, s/CP, 1], ``tokens`` [B, s/CP]):
    that token's position is the largest of the ranks' (a MAX over the group), the rank that
    holds it gives its score and the others 0, summed over the group (over_cp: its
    gradient reaches that rank's token only)."""
    from megatron.core import parallel_state

    group = parallel_state.get_context_parallel_group()
    where = _cp_positions(tokens.shape[1], group, tokens.device)  # where this rank's tokens are
    # as value_head.last_token_index over the whole row: the last non-pad position (0 if none)
    last = (where * (tokens != pad_id)).amax(-1)
    last = collectives.all_reduce(last.clone(), op=torch.distributed.ReduceOp.MAX,
                                  group=group).to(tokens.device)
    here = (where[None, :] == last[:, None]).to(scores.dtype)
    return over_cp((scores[..., 0] * here).sum(-1))
