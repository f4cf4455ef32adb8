"""SwiGLU for the local spec's MLP that keeps only its input for the backward pass.

megatron-core's unfused gated activation (``MLP.forward``'s ``glu``, used without Transformer
Engine) computes ``silu(gate) * (up + glu_linear_offset)``: the addition copies ``up`` even
at the default offset 0, and autograd then keeps the fc1 output (gate and up), silu's output
and that copy: four [tokens, ffn] tensors per layer. Hugging Face's Llama keeps three.
``SwiGLU`` keeps the fc1 output alone (two) and recomputes silu in the backward pass,
running the operators autograd runs for megatron's graph, so outputs and gradients are
bit-identical to megatron's (``tests/test_activation_memory.py``); the recomputation is
elementwise, small next to the layer's matmuls.
``benchmarks/README.md#activation-memory-against-hf`` has the bytes.

megatron builds it as the MLP's ``activation_func`` submodule (``MLPSubmodules``), which its
MLP calls on the whole fc1 output when ``use_te_activation_func`` is set
(``models/gpt.py``): megatron's own hook for an activation module, whatever the name says.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """megatron's gated SiLU on the [..., 2 * ffn] fc1 output: silu(gate) * up."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up


class _SwiGLUFunction(torch.autograd.Function):
    # The operators autograd runs for the unfused graph (silu, mul, mul's backward,
    # silu_backward), each written into a tensor this function already holds: one new
    # [tokens, ffn] tensor per forward (its output) and one fc1-sized gradient per backward,
    # since on CPU every fresh tensor of that size is paid for in page faults.
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        gate, up = torch.chunk(x, 2, dim=-1)
        out = torch.ops.aten.silu.out(
            gate, out=torch.empty_like(gate, memory_format=torch.contiguous_format))
        return out.mul_(up)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        gate, up = torch.chunk(x, 2, dim=-1)
        grad_input = torch.empty_like(x, memory_format=torch.contiguous_format)
        grad_gate, grad_up = torch.chunk(grad_input, 2, dim=-1)
        torch.ops.aten.silu.out(gate, out=grad_up).mul_(grad_output)
        torch.mul(grad_output, up, out=grad_gate)
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return grad_input


class SwiGLU(torch.nn.Module):
    """The MLP's activation submodule: [..., 2 * ffn] -> [..., ffn]."""

    def __init__(self, config=None):
        super().__init__()
        if config is not None:
            if config.activation_func is not F.silu or not config.gated_linear_unit:
                raise ValueError("SwiGLU needs activation_func silu and gated_linear_unit")
            if config.activation_func_clamp_value is not None or config.glu_linear_offset:
                raise ValueError("SwiGLU has no clamp or linear offset (megatron's glu has)")

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """No parameters: nothing in a checkpoint (megatron's MLP asks each submodule)."""
        return {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or not x.requires_grad:
            return swiglu(x)
        return _SwiGLUFunction.apply(x)
