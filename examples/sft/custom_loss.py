"""A custom sft trainer on the Python API: label smoothing on the answer tokens.

  python examples/sft/custom_loss.py --dataset train.jsonl [any `swift-mcore sft` flag]
  python examples/sft/custom_loss.py --smoothing 0 ...     (the plain sft loss)

The loss mask (answers only) and the exact token average over the global batch stay the
base class's: compute_loss returns sums and megatron divides by the batch's target count.
"""

import argparse
import sys

import torch

from swift_mcore import SftArguments, Trainer
from swift_mcore.arguments import build_parser
from swift_mcore.runtime.distributed import exit_process


class LabelSmoothingSftTrainer(Trainer):
    smoothing = 0.1

    def forward_step(self, data_iterator, model):
        batch = self.get_batch(data_iterator)
        # Without labels GPTModel returns logits [batch, seq, vocab] (keep TP=1 here).
        logits = model(input_ids=batch["tokens"], position_ids=batch["position_ids"],
                       attention_mask=batch.get("attention_mask"))
        return logits, lambda output: self.compute_loss(batch, output)

    def compute_loss(self, batch, output_tensor):
        logits = output_tensor.float()
        per_token = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1),
            reduction="none", label_smoothing=self.smoothing).view_as(batch["labels"])
        return super().compute_loss(batch, per_token)


def main():
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--smoothing", type=float, default=0.1)
    opts, rest = own.parse_known_args(sys.argv[1:])
    given = vars(build_parser("custom_loss.py", cls=SftArguments).parse_args(rest))
    given.pop("config", None)
    LabelSmoothingSftTrainer.smoothing = opts.smoothing
    state = LabelSmoothingSftTrainer(SftArguments.from_flags(**given)).train()
    print(f"custom sft trainer finished at iteration {state.iteration}")
    exit_process(0)  # shuts the process groups down and ends without gloo's teardown


if __name__ == "__main__":
    main()
