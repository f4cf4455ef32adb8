"""A custom trainer on the Python API: label-smoothed loss, without copying the loop.

Run:  python examples/custom_trainer.py                    (pretraining, one process)
      torchrun --nproc_per_node 2 examples/custom_trainer.py
      python examples/custom_trainer.py --train_iters 10    (any `swift-mcore pt` flag)
      python examples/custom_trainer.py sft --dataset train.jsonl   (finetuning: any
                                                    `swift-mcore sft` flag; answers only)
      python examples/custom_trainer.py --smoothing 0 ...   (the plain loss)

The loss mask (for sft: the answer tokens) and the exact token average over the global
batch stay the base class's: compute_loss returns sums, megatron divides by the count.
"""

import argparse
import sys

import torch

from swift_mcore import RunArguments, SftArguments, Trainer
from swift_mcore.arguments import build_parser
from swift_mcore.runtime.distributed import exit_process

DEFAULTS = dict(
    num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
    seq_length=128, micro_batch_size=4, global_batch_size=8, train_iters=40, lr=2e-3,
    lr_warmup_iters=4, log_interval=10, eval_steps=0, output_dir="output/custom-trainer")


class LabelSmoothingTrainer(Trainer):
    """Overrides two hooks: the forward step asks for logits, the loss smooths labels."""

    smoothing = 0.1

    def forward_step(self, data_iterator, model):
        batch = self.get_batch(data_iterator)
        # Without labels megatron's GPTModel returns logits [batch, seq, vocab] (this
        # rank's vocabulary shard under tensor parallelism: keep TP=1 for this loss).
        # attention_mask / packed_seq_params: set for packed sft rows (keep their
        # conversations apart; which one, the run's config.packed_rows decided).
        logits = model(input_ids=batch["tokens"], position_ids=batch["position_ids"],
                       attention_mask=batch.get("attention_mask"),
                       packed_seq_params=batch.get("packed_seq_params"))
        return logits, lambda output: self.compute_loss(batch, output)

    def compute_loss(self, batch, output_tensor):
        logits = output_tensor.float()
        per_token = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1),
            reduction="none", label_smoothing=self.smoothing).view_as(batch["labels"])
        # Reuse the base class's token-sum bookkeeping (exact averaging over the batch).
        return super().compute_loss(batch, per_token)


def main():
    argv = sys.argv[1:]
    cls = RunArguments
    if argv[:1] == ["sft"]:
        cls, argv = SftArguments, argv[1:]
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--smoothing", type=float, default=LabelSmoothingTrainer.smoothing)
    opts, argv = own.parse_known_args(argv)
    given = vars(build_parser("custom_trainer.py", cls=cls).parse_args(argv))  # flags given
    given.pop("config", None)
    LabelSmoothingTrainer.smoothing = opts.smoothing
    state = LabelSmoothingTrainer(cls.from_flags(**{**DEFAULTS, **given})).train()
    print(f"custom trainer finished at iteration {state.iteration}")
    exit_process(0)  # shuts the process groups down and ends without gloo's teardown


if __name__ == "__main__":  # dist_checkpointing's writer processes re-import this file
    main()
