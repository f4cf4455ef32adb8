"""The routed experts of a CPU MoE layer as one autograd function over all local experts.

megatron-core 0.16.1 runs the experts of its local layer spec as ``SequentialMLP``
(moe/experts.py:820): one megatron ``MLP`` module per expert, each a fc1 linear, the
activation, the routing-weight product and a fc2 linear, every one an autograd node, the
linears on oneDNN where --cpu_matmul chose it (onednn_linear.py). An expert's row count
changes every micro-batch, and oneDNN builds a primitive for each new shape: in a
``swift-mcore pt`` run (benchmarks/moe_throughput.py's shape) the experts' products took
over three times the CPU time of the dense MLP's with the same FLOPs. torch 2.13's
``torch._grouped_mm`` runs on the CPU but loops over plain matmuls, slower than the same
loop here. So ``GroupedExperts`` keeps SequentialMLP's modules and parameters (the same
names, layout and checkpoints) and replaces only its forward: one
``torch.autograd.Function`` runs every expert's products on MKL (no per-shape setup) and
its SwiGLU back to back, writing into one output, and has its own backward, the weight
gradients added into DDP's ``main_grad`` as megatron's fused accumulation does. It keeps
the fc1 output for the backward pass and recomputes the activation, as models/swiglu.py
does.

Only where SequentialMLP's forward would be plain: fp32, the local spec's SwiGLU (the
class models/gpt.py hands in, models/swiglu.py) without bias, clamp or fp8, the experts'
linears megatron's own (not a LoRA layer), expert tensor parallelism 1 and no deferred
weight gradients. Anything else runs SequentialMLP's forward unchanged.
tests/test_grouped_experts.py holds it equal to SequentialMLP, forward and backward,
main_grad included.
"""

from __future__ import annotations

from typing import List

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.moe.experts import SequentialMLP


def _product(rows: torch.Tensor, weight: torch.Tensor, out=None) -> torch.Tensor:
    """rows @ weight.T on MKL whatever --cpu_matmul chose for the other linears: an expert's
    row count changes every micro-batch, and oneDNN builds (and caches) a primitive per new
    shape, which at these sizes costs more than the product (onednn_linear.py's linears
    see one shape per run)."""
    return torch.mm(rows, weight.t(), out=out)


def _weight_gradient(ctx_main_grad, linear, weight, rows, grad_output):
    """What megatron's linear returns for its weight (onednn_linear._Linear's bookkeeping):
    with gradient accumulation fusion the product is added into ``main_grad`` and a
    placeholder goes to DDP's hook; else the gradient itself."""
    if linear.gradient_accumulation_fusion and ctx_main_grad is not None:
        weight.main_grad = ctx_main_grad
        if rows.dtype == ctx_main_grad.dtype:
            ctx_main_grad.addmm_(grad_output.t(), rows)
        else:
            ctx_main_grad.add_(grad_output.t().matmul(rows))
        if hasattr(weight, "grad_added_to_main_grad"):
            make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
            weight.grad_added_to_main_grad = True
            return make(ctx_main_grad.shape, dtype=rows.dtype)
        return None
    return grad_output.t().matmul(rows)


class _GroupedExpertsFunction(torch.autograd.Function):
    """All local experts: out[rows of e] = (swiglu(x_e W1_e^T) * p_e) W2_e^T. Keeps each
    expert's fc1 output for the backward pass (its activation is recomputed there)."""

    @staticmethod
    def forward(ctx, hidden, probs, counts: List[int], module, *weights):
        experts = len(counts)
        fc1_weights, fc2_weights = weights[:experts], weights[experts:]
        fc1_outs = []
        output = hidden.new_empty(hidden.shape[0], fc2_weights[0].shape[0])
        start = 0
        for count, w1, w2 in zip(counts, fc1_weights, fc2_weights):
            stop = start + count
            if count:
                h = _product(hidden[start:stop], w1)
                gate, up = torch.chunk(h, 2, dim=-1)
                # megatron's order: silu(gate) * up, then times the routing weight
                act = torch.ops.aten.silu.out(
                    gate, out=torch.empty_like(gate, memory_format=torch.contiguous_format))
                act.mul_(up).mul_(probs[start:stop].unsqueeze(-1))
                _product(act, w2, out=output[start:stop])
            else:
                h = hidden.new_empty(0, w1.shape[0])
            fc1_outs.append(h)
            start = stop
        ctx.counts, ctx.module = counts, module
        ctx.main_grads = [getattr(w, "main_grad", None) for w in weights]
        ctx.save_for_backward(hidden, probs, *fc1_outs, *weights)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        counts, module = ctx.counts, ctx.module
        experts = len(counts)
        hidden, probs, *rest = ctx.saved_tensors
        fc1_outs, weights = rest[:experts], rest[experts:]
        grad_output = grad_output.contiguous()
        grad_hidden = torch.empty_like(hidden)
        grad_probs = torch.empty_like(probs)
        weight_grads = [None] * (2 * experts)
        want_weights = ctx.needs_input_grad[4:]
        start = 0
        for e, count in enumerate(counts):
            w1, w2 = weights[e], weights[experts + e]
            expert = module.local_experts[e]
            stop = start + count
            if count == 0:
                for i, linear in ((e, expert.linear_fc1), (experts + e, expert.linear_fc2)):
                    if want_weights[i]:
                        weight_grads[i] = _weight_gradient(
                            ctx.main_grads[i], linear, weights[i],
                            hidden.new_empty(0, weights[i].shape[1]),
                            hidden.new_empty(0, weights[i].shape[0]))
                continue
            h = fc1_outs[e]
            gate, up = torch.chunk(h, 2, dim=-1)
            p = probs[start:stop].unsqueeze(-1)
            g_out = grad_output[start:stop]
            silu = torch.ops.aten.silu.out(
                gate, out=torch.empty_like(gate, memory_format=torch.contiguous_format))
            act = silu * up
            g_scaled = _product(g_out, w2.t())  # fc2's input gradient
            # the routing weight's gradient: scaled = act * p
            torch.linalg.vecdot(g_scaled, act, out=grad_probs[start:stop])
            if want_weights[experts + e]:
                weight_grads[experts + e] = _weight_gradient(
                    ctx.main_grads[experts + e], expert.linear_fc2, w2, act.mul_(p), g_out)
            g_act = g_scaled.mul_(p)
            # SwiGLU's backward (models/swiglu.py): d up = silu(gate) g, d gate through silu
            g_h = torch.empty_like(h)
            g_gate, g_up = torch.chunk(g_h, 2, dim=-1)
            torch.mul(g_act, up, out=g_gate)
            torch.ops.aten.silu_backward.grad_input(g_gate, gate, grad_input=g_gate)
            torch.mul(silu, g_act, out=g_up)
            if want_weights[e]:
                weight_grads[e] = _weight_gradient(ctx.main_grads[e], expert.linear_fc1, w1,
                                                   hidden[start:stop], g_h)
            _product(g_h, w1.t(), out=grad_hidden[start:stop])
            start = stop
        return (grad_hidden, grad_probs if ctx.needs_input_grad[1] else None, None, None,
                *weight_grads)


class GroupedExperts(SequentialMLP):
    """megatron's SequentialMLP (same submodules, parameters and sharded state dict) whose
    forward runs all local experts in one autograd function where it can. ``swiglu``: the
    activation module class that computes silu(gate) * up on the fc1 output (the models'
    SwiGLU; this folder does not import models); experts with another run SequentialMLP's
    forward."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None,
                 swiglu=None):
        super().__init__(num_local_experts, config, submodules, pg_collection)
        self.swiglu = swiglu

    def _grouped(self, hidden: torch.Tensor, probs: torch.Tensor) -> bool:
        c = self.config
        if (c.fp8 or c.fp4 or c.moe_apply_probs_on_input or c.add_bias_linear
                or getattr(c, "delay_wgrad_compute", False) or self.tp_group.size() != 1
                or hidden.dtype != torch.float32 or probs.dtype != torch.float32
                or hidden.device.type != "cpu" or hidden.dim() != 2):
            return False
        if self.swiglu is None or not c.use_te_activation_func:
            return False
        for expert in self.local_experts:
            if (type(expert.linear_fc1) is not ColumnParallelLinear
                    or type(expert.linear_fc2) is not RowParallelLinear
                    or type(expert.activation_func) is not self.swiglu):
                return False
        return True

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if not self._grouped(permuted_local_hidden_states, permuted_probs):
            return super().forward(permuted_local_hidden_states, tokens_per_expert,
                                   permuted_probs)
        counts = [int(n) for n in tokens_per_expert.tolist()]
        weights = [e.linear_fc1.weight for e in self.local_experts] + \
            [e.linear_fc2.weight for e in self.local_experts]
        output = _GroupedExpertsFunction.apply(permuted_local_hidden_states, permuted_probs,
                                               counts, self, *weights)
        return output, None
