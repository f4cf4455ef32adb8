"""The LoRA up-projection added into the base layer's output as one product: result + h·Bᵀ.

peft's layer computes ``delta = B(h)`` and then ``result + delta``: two new tensors of the
base output's size ([tokens, out_features]) per adapted linear, each written once and read
again, where the adapter's own products are rank-r thin. On CPU a tensor that size (a
100m model's linear_fc1: 2,048 tokens x 5,504) is a fresh mapping of the allocator's, so
each costs its page faults as well as its pass (benchmarks/README.md, "LoRA against full
finetuning"). ``torch.addmm(result, h, Bᵀ)`` is the same sum in one tensor. Its backward is
the add's and B's: the output's gradient passes to ``result`` as it is, ``h`` gets
``grad @ B`` and B ``gradᵀ @ h``.

Only where B's module adds nothing to the product: one tensor-parallel rank (megatron's
ColumnParallelLinear is then a plain matmul) or a replicated ``nn.Linear`` B, no sequence
parallelism, 2-D or more inputs of one dtype. Elsewhere the LoRA layer calls B's module.
"""

from __future__ import annotations

import torch
from torch import nn


class _AddLowRank(torch.autograd.Function):
    @staticmethod
    def forward(ctx, result, h, weight):
        ctx.save_for_backward(h, weight)
        rows = result.reshape(-1, result.shape[-1])
        out = torch.addmm(rows, h.reshape(-1, h.shape[-1]), weight.t())
        return out.view(result.shape)

    @staticmethod
    def backward(ctx, grad):
        h, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        grad_h = grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_h = rows.mm(weight).view(h.shape)
        if ctx.needs_input_grad[2]:
            grad_weight = rows.t().mm(h.reshape(-1, h.shape[-1]))
        return grad, grad_h, grad_weight


def plain_weight(module, sequence_parallel: bool):
    """B's weight when its module is a plain matmul (see the module docstring), else None."""
    from megatron.core import tensor_parallel
    from megatron.core.utils import get_pg_size

    if sequence_parallel:
        return None
    if type(module) is nn.Linear and module.bias is None:
        return module.weight
    if (type(module) is tensor_parallel.ColumnParallelLinear and module.bias is None
            and not module.sequence_parallel and get_pg_size(module.tp_group) == 1):
        return module.weight  # its own group: one rank, so its forward is a plain matmul
    return None


def add_low_rank(result: torch.Tensor, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``result + h @ weight.T`` in one new tensor, differentiable in all three."""
    return _AddLowRank.apply(result, h, weight)
