"""gpt-oss's experts on megatron's own MLP: the clamped SwiGLU as megatron's gated unit with
quick_gelu, a linear offset of 1 and a clamp (TransformerConfig's glu_linear_offset and
activation_func_clamp_value), the expert and router biases as add_bias_linear.

transformers' GptOssExperts computes, per expert, with gate and up its interleaved halves:
``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate, max=limit)``,
which is megatron's unfused glu (mlp.py, experts.py: ``activation_func(x_glu) * (x_linear +
glu_linear_offset)`` after the same clamps) with activation_func = quick_gelu
(``y * sigmoid(1.702 * y)``): alpha must be 1.702 (the family refuses another).
"""

from __future__ import annotations

# transformers' swiglu_alpha that megatron's quick_gelu has built in
QUICK_GELU_ALPHA = 1.702


def transformer_fields(m) -> dict:
    """TransformerConfig fields of a gpt-oss model beyond the common ones."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return dict(gated_linear_unit=True, activation_func=quick_gelu, glu_linear_offset=1.0,
                activation_func_clamp_value=m.activation_func_clamp_value,
                bias_activation_fusion=False)


def expert_fc2_class():
    """megatron's RowParallelLinear for a routed expert's linear_fc2, skipping the reduction
    over an expert tensor-parallel group of one rank (an identity).

    With biased experts megatron's MLP adds the routing-weighted bias into fc2's output in
    place (mlp.py:247); at expert TP 1 without expert parallelism that output is what the
    identity reduction returned as-is, and autograd forbids the in-place add on it. With
    TP or EP > 1 megatron itself skips the reduction (``explicit_expert_comm``); so does
    this class at TP 1, where it changes no number."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.utils import get_pg_size

    class ExpertRowParallelLinear(RowParallelLinear):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.is_expert and get_pg_size(self.tp_group) == 1 and self.skip_bias_add:
                self.explicit_expert_comm = True

    return ExpertRowParallelLinear


def adapt_moe_spec(spec):
    """The local spec of an MoE layer whose routed experts have biases (--add_bias_linear)."""
    spec.submodules.mlp.submodules.experts.submodules.linear_fc2 = expert_fc2_class()
    return spec
