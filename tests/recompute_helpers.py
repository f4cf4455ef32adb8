"""Gradients of one tiny GPT step with and without activation recompute (dropout on), in this
process or on each rank of a world of 2 (TP=2 on gloo, through two_ranks.py)."""

from __future__ import annotations

import torch

MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
             seq_length=32, micro_batch_size=2, global_batch_size=2, hidden_dropout=0.1,
             attention_dropout=0.1, attention_backend="local")

# name -> flags; each is compared with "none" (no recompute)
CASES = {
    "none": {},
    "selective core_attn": dict(recompute_granularity="selective"),
    "selective mlp": dict(recompute_granularity="selective", recompute_modules=["mlp"]),
    "selective layernorm": dict(recompute_granularity="selective",
                                recompute_modules=["layernorm"]),
    "selective all": dict(recompute_granularity="selective",
                          recompute_modules=["core_attn", "layernorm", "mlp"]),
    "full uniform 1": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=1),
    "full uniform 2": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=2),
    "full block 3": dict(recompute_granularity="full", recompute_method="block",
                         recompute_num_layers=3),
}


def gradients(flags: dict, tp: int = 1, dropout_seed: int = 5) -> dict:
    """{parameter name: gradient} of the summed token losses of one fixed micro-batch."""
    from swift_mcore.arguments import RunArguments
    from swift_mcore.models.gpt import build_model
    from swift_mcore.run_config import resolve
    from swift_mcore.runtime import seed

    config = resolve(RunArguments.from_flags(
        **MODEL, tensor_model_parallel_size=tp, **flags), world_size=tp, cuda=False).complete(
        256, None, padded_vocab_size=256)
    seed.set_seed(0)
    model = build_model(config)[0]
    model.train()
    seq = MODEL["seq_length"]
    tokens = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(seq).expand(2, seq)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), 1)
    torch.manual_seed(dropout_seed)  # the dropout masks: recompute must draw them again
    loss = model(input_ids=tokens, position_ids=positions, attention_mask=mask, labels=tokens)
    loss.sum().backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def differences(tp: int) -> dict:
    """{case: the largest gradient difference to no recompute}, and "other dropout": the
    difference a different dropout draw makes (the yardstick: it must be far larger)."""
    reference = gradients({}, tp)
    result = {name: max_difference(reference, gradients(flags, tp))
              for name, flags in CASES.items() if name != "none"}
    result["other dropout"] = max_difference(reference, gradients({}, tp, dropout_seed=6))
    return result


def on_each_rank() -> dict:  # one rank of a world of 2: TP=2 (two_ranks.py)
    return differences(tp=2)
