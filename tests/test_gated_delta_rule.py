"""The gated delta rule of the CPU port (runtime/cpu/gated_delta_rule.py) against transformers'
torch functions, and megatron's GatedDeltaNet on it against transformers' Qwen3-Next layer."""

import pytest
import torch
import torch.nn.functional as F

from swift_mcore.runtime.cpu import gated_delta_rule

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only adaptation")

hf_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def inputs(batch=2, length=150, heads=2, value_heads=4, key_dim=8, value_dim=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, heads, key_dim, generator=gen)
    k = torch.randn(batch, length, heads, key_dim, generator=gen)
    v = torch.randn(batch, length, value_heads, value_dim, generator=gen)
    g = -F.softplus(torch.randn(batch, length, value_heads, generator=gen))
    beta = torch.rand(batch, length, value_heads, generator=gen)
    state = torch.randn(batch, value_heads, key_dim, value_dim, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("length", [150, 64, 5])
def test_chunked_rule_equals_transformers(length):
    q, k, v, g, beta, state = inputs(length=length)
    ours, our_state = gated_delta_rule.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    for reference in (hf_next.torch_chunk_gated_delta_rule,
                      hf_next.torch_recurrent_gated_delta_rule):
        theirs, their_state = reference(q, k, v, g=g, beta=beta, initial_state=state,
                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(our_state, their_state, atol=1e-5, rtol=1e-5)


def test_l2norm_equals_transformers():
    x = torch.randn(3, 7, 16)
    torch.testing.assert_close(gated_delta_rule.l2norm(x), hf_next.l2norm(x), atol=1e-6,
                               rtol=1e-6)


def test_packed_documents_do_not_share_state():
    """cu_seqlens (fla's packed rows): each document gives what it gives alone; joined
    without the bounds they do not (the state would leak)."""
    q, k, v, g, beta, _ = inputs(batch=1, length=150)
    bounds = [0, 50, 130, 150]
    packed, states = gated_delta_rule.chunk_gated_delta_rule(
        q, k, v, g, beta, cu_seqlens=torch.tensor(bounds), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    for n, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        piece = slice(start, stop)
        alone, state = hf_next.torch_chunk_gated_delta_rule(
            q[:, piece], k[:, piece], v[:, piece], g=g[:, piece], beta=beta[:, piece],
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(packed[:, piece], alone, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(states[n: n + 1], state, atol=1e-5, rtol=1e-5)
    joined, _ = gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta,
                                                        use_qk_l2norm_in_kernel=True)
    assert not torch.allclose(joined[:, 50:], packed[:, 50:], atol=1e-3)


def test_megatrons_gated_delta_net_equals_qwen3_next_layer(gloo_group):
    """megatron's own GatedDeltaNet, built on the CPU (no fla), with a transformers
    Qwen3-Next layer's weights in megatron's layout (models/delta_net.py): the same output;
    the weights go back to transformers' layout bit for bit."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from transformers import Qwen3NextConfig

    from swift_mcore.models.delta_net import DeltaNet

    hf_config = Qwen3NextConfig(hidden_size=32, linear_num_key_heads=2,
                                linear_num_value_heads=4, linear_key_head_dim=8,
                                linear_value_head_dim=6, linear_conv_kernel_dim=4,
                                num_hidden_layers=1, layer_types=["linear_attention"])
    torch.manual_seed(0)
    hf = hf_next.Qwen3NextGatedDeltaNet(hf_config, 0).eval()
    with torch.no_grad():
        for p in hf.parameters():  # off init: every tensor matters
            p.add_(torch.randn_like(p) * 0.1)
    layout = DeltaNet(hidden=32, key_heads=2, value_heads=4, key_dim=8, value_dim=6,
                      conv_kernel=4)
    config = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=2, normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps, activation_func=F.silu,
        add_bias_linear=False, use_cpu_initialization=True, perform_initialization=False,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=[1],
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6,
        linear_num_key_heads=2, linear_num_value_heads=4)
    spec = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear))
    ours = build_module(spec, config=config, layer_number=1,
                        pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    hf_state = {f"model.layers.0.linear_attn.{k}": t for k, t in hf.state_dict().items()}
    with torch.no_grad():
        for name, param in ours.named_parameters():
            param.copy_(layout.to_mcore(f"self_attention.{name}", "model.layers.0.",
                                        lambda n: hf_state[n]))
    x = torch.randn(2, 70, 32)  # [batch, seq, hidden]
    with torch.no_grad():
        expected = hf(x)
        got, _ = ours(x.transpose(0, 1).contiguous(), attention_mask=None)
    torch.testing.assert_close(got.transpose(0, 1), expected, atol=1e-5, rtol=1e-5)
    mcore = {f"decoder.layers.0.self_attention.{n}": p.detach()
             for n, p in ours.named_parameters()}
    for name, tensor in hf_state.items():
        back = layout.to_hf(name.removeprefix("model.layers.0."), "decoder.layers.0.",
                            mcore.__getitem__)
        assert torch.equal(back, tensor), name


def test_chunked_rule_equals_megatrons_torch_path():
    """megatron's own torch fallback (its deterministic mode; q and k already normalised,
    as its GatedDeltaNet passes them): the same output and final state."""
    from megatron.core.ssm import gated_delta_net

    q, k, v, g, beta, state = inputs(heads=4, value_heads=4, length=100)
    q, k = gated_delta_rule.l2norm(q), gated_delta_rule.l2norm(k)
    ours, our_state = gated_delta_rule.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True)
    theirs, their_state = gated_delta_net.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(our_state, their_state, atol=1e-5, rtol=1e-5)


def _with_grads(rule, tensors, weights, **kwargs):
    """rule's output and final state, and the gradients of a weighted sum of both with
    respect to every input."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out, state = rule(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kwargs)
    ((out * weights[0]).sum() + (state * weights[1]).sum()).backward()
    return [out.detach(), state.detach()] + [t.grad for t in leaves]


def _close_to_largest(ours, theirs, tolerance=1e-6):
    for name, a, b in zip(["output", "state", "dq", "dk", "dv", "dg", "dbeta", "dstate"],
                          ours, theirs):
        error = (a - b).abs().max().item() / b.abs().max().item()
        assert error < tolerance, f"{name}: {error:.2e} of the largest value"


@pytest.mark.parametrize("length", [150, 128])
def test_gradients_equal_megatrons_torch_path(length):
    """Output, final state and every input's gradient (q, k, v, g, beta and the initial
    state) within 1e-6 of the largest value of megatron's own torch path."""
    from megatron.core.ssm import gated_delta_net

    q, k, v, g, beta, state = inputs(heads=4, value_heads=4, length=length, key_dim=16,
                                     value_dim=8)
    q, k = gated_delta_rule.l2norm(q), gated_delta_rule.l2norm(k)
    gen = torch.Generator().manual_seed(1)
    weights = (torch.randn(v.shape, generator=gen), torch.randn(state.shape, generator=gen))
    _close_to_largest(
        _with_grads(gated_delta_rule.chunk_gated_delta_rule, (q, k, v, g, beta, state),
                    weights),
        _with_grads(gated_delta_net.torch_chunk_gated_delta_rule, (q, k, v, g, beta, state),
                    weights))


def test_packed_gradients_equal_each_document_alone():
    """Packed rows (cu_seqlens): the output, each document's final state and every gradient
    within 1e-6 of the largest value of megatron's torch path on each document alone, so
    neither the state nor its gradient crosses a document boundary."""
    from megatron.core.ssm import gated_delta_net

    q, k, v, g, beta, _ = inputs(batch=1, heads=4, value_heads=4, length=150, key_dim=16,
                                 value_dim=8)
    q, k = gated_delta_rule.l2norm(q), gated_delta_rule.l2norm(k)
    bounds = [0, 50, 130, 150]
    gen = torch.Generator().manual_seed(2)
    states = torch.randn(len(bounds) - 1, 4, 16, 8, generator=gen)
    weights = (torch.randn(v.shape, generator=gen), torch.randn(states.shape, generator=gen))
    packed = _with_grads(gated_delta_rule.chunk_gated_delta_rule,
                         (q, k, v, g, beta, states), weights, cu_seqlens=torch.tensor(bounds))
    for n, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        piece, doc = slice(start, stop), slice(n, n + 1)
        alone = _with_grads(gated_delta_net.torch_chunk_gated_delta_rule,
                            [t[:, piece] for t in (q, k, v, g, beta)] + [states[doc]],
                            (weights[0][:, piece], weights[1][doc]))
        ours = [packed[0][:, piece], packed[1][doc]] + [
            t[:, piece] for t in packed[2:7]] + [packed[7][doc]]
        _close_to_largest(ours, alone)
