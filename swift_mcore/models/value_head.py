"""A reward model's score head: a [num_labels, hidden] linear layer in place of GPTModel's LM
head, and the score of a sequence read at its last non-pad token (transformers' rule).

The head is transformers' ``score`` of ``*ForSequenceClassification`` (no bias). It sits in
GPTModel's ``output_layer`` slot, so megatron's forward, checkpoints, DDP and the export
treat it as the model's last layer; GPTModel returns [batch, sequence, num_labels]. Every
tensor-parallel rank holds the whole head (it is tiny): its input, the final norm's output,
is whole on every rank, so each rank computes the same scores and the same gradients.
Under --sequence_parallel each rank holds a slice of the sequence: the head gathers the
whole sequence first, and its backward hands each rank its own slice's gradient (no sum:
every rank computed the same scores).

A fresh head (a reward model started from a causal LM) is drawn from
normal(0, --init_method_std) by a generator seeded with --seed alone, the same on every
rank and whatever the model's other weights drew (docs/rlhf.md).
"""

from __future__ import annotations

import torch


class ValueHead(torch.nn.Module):
    """Called as megatron calls its output layer: ``(hidden, weight=..., ...)`` ->
    ``(scores, None)``; a tied embedding weight megatron passes is not this head's."""

    def __init__(self, hidden_size: int, num_labels: int, std: float, seed: int,
                 dtype: torch.dtype = torch.float32, device=None,
                 gather_sequence: bool = False):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        weight = torch.empty(num_labels, hidden_size, dtype=torch.float32)
        weight.normal_(0.0, std, generator=generator)
        self.weight = torch.nn.Parameter(weight.to(dtype=dtype, device=device))
        # megatron's GPTModel reads these of its output layer
        self.sequence_parallel = False
        self.gather_sequence = gather_sequence

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.gather_sequence:
            from megatron.core import tensor_parallel

            # the same head on every rank: a rank's gradient is its own slice's, unsummed
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False)
        return torch.matmul(hidden_states, self.weight.t()), None


def install(model, config, tc) -> None:
    """Put the score head in ``model``'s output layer slot (the last pipeline stage's)."""
    if not getattr(model, "post_process", True):
        return
    device = torch.cuda.current_device() if config.cuda else None
    model.output_layer = ValueHead(config.model.hidden_size, config.model.num_labels,
                                   config.model.init_method_std, config.training.seed,
                                   dtype=tc.params_dtype, device=device,
                                   gather_sequence=tc.sequence_parallel)


def last_token_index(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Per row, the position of its last token that is not ``pad_id`` (0 for a row of pads):
    where transformers' *ForSequenceClassification reads its score."""
    positions = torch.arange(tokens.shape[-1], device=tokens.device)
    return (positions * (tokens != pad_id)).argmax(-1)


def pooled(scores: torch.Tensor, tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """[batch, num_labels] from the head's [batch, sequence, num_labels] output."""
    index = last_token_index(tokens, pad_id).to(scores.device)
    return scores[torch.arange(scores.shape[0], device=scores.device), index]


@torch.no_grad()
def score_sequences(model, sequences, pad_id: int) -> torch.Tensor:
    """Scores [n, num_labels] of token-id lists with a whole (TP=PP=1) reward model, the
    sequences right-padded with ``pad_id`` into one batch."""
    width = max(len(s) for s in sequences)
    tokens = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    for i, ids in enumerate(sequences):
        tokens[i, :len(ids)] = torch.as_tensor(ids, dtype=torch.long)
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    positions = torch.arange(width, device=device).unsqueeze(0).expand_as(tokens)
    out = model(input_ids=tokens, position_ids=positions, attention_mask=None).float()
    return pooled(out, tokens, pad_id)


def pad_id_of(tokenizer) -> int:
    """The pad token a reward model reads scores by: the tokenizer's, else its EOS (TRL's
    RewardTrainer's choice)."""
    pad = getattr(tokenizer.hf, "pad_token_id", None)
    return pad if pad is not None else tokenizer.eod


SEQUENCE_CLASSIFICATION = "ForSequenceClassification"


def is_score_config(config: dict) -> bool:
    """Whether a config.json describes transformers' *ForSequenceClassification model."""
    names = config.get("architectures") or []
    return bool(names) and isinstance(names[0], str) and \
        names[0].endswith(SEQUENCE_CLASSIFICATION)


def config_num_labels(config: dict) -> int:
    """A *ForSequenceClassification config.json's label count, as transformers reads it
    (its id2label; 2 when it has none)."""
    labels = config.get("id2label")
    if isinstance(labels, dict) and labels:
        return len(labels)
    value = config.get("num_labels")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 2
