"""megatron's linear layers on CPU with their forward and input-gradient products on oneDNN.

Without CUDA, megatron-core's ColumnParallelLinear and RowParallelLinear multiply with
``torch.matmul`` (layers.py:341, 351, 488, 531), which for fp32 on CPU is MKL's sgemm. torch
ships a second fp32 GEMM, oneDNN's, as ``torch.ops.mkldnn._linear_pointwise`` (the kernel
torch.compile's CPU backend emits for linears). On the CPUs this project is measured on it
runs the layers' forward and input-gradient products, and whole training steps, faster than
MKL (``benchmarks/cpu_matmul.py``; benchmarks/README.md#the-cpu-gemm-onednn-against-mkl).
``--cpu_matmul auto`` (the default, ``choose``) takes it wherever torch has it.

oneDNN sums in another order than MKL, so the products agree within fp32 rounding, not bit
for bit: a run resumes bit-exactly only under the same --cpu_matmul, as under the same
thread count. Each backend on its own is deterministic.

What this path takes: fp32 CPU tensors, without sequence parallelism or deferred weight
gradients (a GPU pipeline's option). Anything else goes to megatron's own Function. The
weight gradient stays megatron's: with gradient_accumulation_fusion it is added into DDP's
``main_grad`` in one MKL ``addmm_`` (cpu_compat._WeightGradientAccumulation). oneDNN has
no accumulating form, and its product plus a separate add was slower for most shapes.
"""

from __future__ import annotations

import torch

_STATE = {"enabled": False}


def available() -> bool:
    """Whether this torch has the oneDNN linear (a CPU build with mkldnn)."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def choose(flag: str) -> str:
    """--cpu_matmul -> the GEMM megatron's linears use: 'auto' is oneDNN where this torch
    has it, else MKL. Raises ArgumentError for 'onednn' on a torch without it."""
    if flag == "onednn" and not available():
        from ...errors import ArgumentError

        raise ArgumentError("--cpu_matmul onednn: this torch build has no oneDNN linear "
                            "(torch.ops.mkldnn._linear_pointwise); choose auto or mkl")
    if flag == "auto":
        return "onednn" if available() else "mkl"
    return flag


def enable(on: bool) -> None:
    """The resolved --cpu_matmul: oneDNN (True) or megatron's torch.matmul (False)."""
    if on and not available():
        raise RuntimeError("oneDNN's linear is not in this torch build")
    _STATE["enabled"] = bool(on)


def enabled() -> bool:
    return _STATE["enabled"]


def _onednn(x2d: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """x2d @ weight.T (+ bias); weight may be a transposed view."""
    return torch.ops.mkldnn._linear_pointwise(x2d, weight, bias, "none", [], "")


def _takes(input, weight, bias) -> bool:
    return (_STATE["enabled"] and input.device.type == "cpu" and input.numel() > 0
            and input.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.dim() == 2 and (bias is None or bias.dtype == torch.float32))


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.is_contiguous() else rows.contiguous()


class _Linear(torch.autograd.Function):
    """megatron's LinearWithGradAccumulationAndAsyncCommunication (layers.py:443-626) for
    2-D rows without sequence parallelism: the same gradients and main_grad bookkeeping."""

    @staticmethod
    def forward(ctx, rows, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                tp_group):
        ctx.save_for_backward(rows, weight)
        # As megatron: main_grad rides on ctx, not in save_for_backward (a module reused
        # across layers would trip autograd's in-place checks).
        ctx.main_grad = (weight.main_grad if gradient_accumulation_fusion
                         and hasattr(weight, "main_grad") else None)
        ctx.fusion = gradient_accumulation_fusion
        ctx.allreduce_dgrad, ctx.tp_group, ctx.use_bias = allreduce_dgrad, tp_group, \
            bias is not None
        return _onednn(rows, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        from megatron.core.tensor_parallel import layers

        rows, weight = ctx.saved_tensors
        grad_output = grad_output if grad_output.is_contiguous() else grad_output.contiguous()
        grad_input = _onednn(grad_output, weight.t())
        handle = None
        if ctx.allreduce_dgrad:
            handle = torch.distributed.all_reduce(grad_input, group=ctx.tp_group,
                                                  async_op=True)
        grad_weight = None
        if ctx.fusion:
            weight.main_grad = ctx.main_grad
            layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(
                rows, grad_output, weight.main_grad)
            if hasattr(weight, "grad_added_to_main_grad"):
                # megatron's placeholder for DDP's hook, which sees the flag and drops it
                make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
                grad_weight = make(weight.main_grad.shape, dtype=rows.dtype)
                weight.grad_added_to_main_grad = True
        elif ctx.needs_input_grad[1]:
            grad_weight = grad_output.t().matmul(rows)
        grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
        if handle is not None:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None, None, None


class _FrozenLinear(torch.autograd.Function):
    """megatron's LinearWithFrozenWeight (layers.py:325-357): keeps only the weight."""

    @staticmethod
    def forward(ctx, rows, weight, bias, allreduce_dgrad, tp_group):
        ctx.save_for_backward(weight)
        ctx.allreduce_dgrad, ctx.tp_group = allreduce_dgrad, tp_group
        return _onednn(rows, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        (weight,) = ctx.saved_tensors
        grad_output = grad_output if grad_output.is_contiguous() else grad_output.contiguous()
        grad_input = _onednn(grad_output, weight.t())
        if ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        return grad_input, None, None, None, None


def _shaped(out_rows: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    return out_rows.view(*input.shape[:-1], out_rows.shape[-1])


def make_linear(original):
    """Stands in for megatron's Function class (its ``apply``, the one thing
    ``linear_with_grad_accumulation_and_async_allreduce`` calls on it)."""

    class Linear:
        _swift_mcore_original = original

        @staticmethod
        def apply(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                  sequence_parallel, grad_output_buffer, wgrad_deferral_limit, tp_group):
            if sequence_parallel or grad_output_buffer is not None \
                    or not _takes(input, weight, bias):
                return original.apply(input, weight, bias, gradient_accumulation_fusion,
                                      allreduce_dgrad, sequence_parallel, grad_output_buffer,
                                      wgrad_deferral_limit, tp_group)
            return _shaped(_Linear.apply(_as_rows(input), weight, bias,
                                         gradient_accumulation_fusion, allreduce_dgrad,
                                         tp_group), input)

    return Linear


def make_frozen_linear(original):
    """Stands in for megatron's LinearWithFrozenWeight (``linear_with_frozen_weight`` calls
    its ``apply`` after any sequence-parallel gather)."""

    class FrozenLinear:
        _swift_mcore_original = original

        @staticmethod
        def apply(input, weight, bias, allreduce_dgrad, tp_group):
            if not _takes(input, weight, bias):
                return original.apply(input, weight, bias, allreduce_dgrad, tp_group)
            return _shaped(_FrozenLinear.apply(_as_rows(input), weight, bias, allreduce_dgrad,
                                               tp_group), input)

    return FrozenLinear
