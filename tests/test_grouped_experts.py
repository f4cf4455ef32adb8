"""runtime/cpu/grouped_experts.py: a CPU MoE layer's experts in one autograd function give
megatron's SequentialMLP's outputs and gradients (main_grad included), keep its parameters
and checkpoint keys, and step aside wherever SequentialMLP's forward is not the plain one."""

import pytest
import torch

from swift_mcore.arguments import parse_args
from swift_mcore.run_config import resolve
from swift_mcore.runtime.cpu import onednn_linear

TOL = dict(rtol=1e-6, atol=1e-6)


def _config(*extra):
    return resolve(parse_args([
        "--num_layers", "2", "--micro_batch_size", "2", "--global_batch_size", "2",
        "--hidden_size", "32", "--num_attention_heads", "4", "--seq_length", "16",
        "--num_experts", "4", "--moe_router_topk", "2", "--ffn_hidden_size", "24",
        "--moe_layer_freq", "[0,1]", "--moe_aux_loss_coeff", "0.01", *extra]),
        world_size=1, cuda=False).complete(256, None)


def _models(monkeypatch, config):
    """The same model (same seed) with the CPU port's experts and with megatron's own."""
    from swift_mcore.models import gpt
    from swift_mcore.runtime import cpu
    from swift_mcore.runtime.seed import set_seed

    set_seed(1)
    grouped = gpt.build_model(config)[0]
    with monkeypatch.context() as patch:
        patch.setattr(cpu, "expert_module", lambda config: None)
        set_seed(1)
        sequential = gpt.build_model(config)[0]
    return grouped, sequential


@pytest.fixture
def matmul_off_after():
    yield
    onednn_linear.enable(False)


def test_cpu_moe_layers_take_grouped_experts_with_sequential_mlps_state(gloo_group,
                                                                       monkeypatch):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from swift_mcore.runtime.cpu.grouped_experts import GroupedExperts

    grouped, sequential = _models(monkeypatch, _config())
    experts = grouped.decoder.layers[1].mlp.experts
    assert type(experts) is GroupedExperts and isinstance(experts, SequentialMLP)
    assert type(sequential.decoder.layers[1].mlp.experts) is SequentialMLP
    state, reference = grouped.state_dict(), sequential.state_dict()
    assert list(state) == list(reference)
    assert all(torch.equal(state[k], reference[k]) for k in state
               if torch.is_tensor(state[k]))
    assert sorted(grouped.sharded_state_dict()) == sorted(sequential.sharded_state_dict())


@pytest.mark.parametrize("onednn", [False, True])
@pytest.mark.parametrize("fusion", [False, True])
def test_grouped_experts_equal_sequential_mlp(gloo_group, monkeypatch, matmul_off_after,
                                              onednn, fusion):
    """Forward and backward of the experts alone, one expert given no tokens; with
    ``fusion`` the weight gradients go into main_grad as megatron's fused path adds them.
    The grouped products stay on MKL whatever --cpu_matmul chose (grouped_experts._product)."""
    if onednn and not onednn_linear.available():
        pytest.skip("this torch build has no oneDNN linear")
    grouped, sequential = _models(monkeypatch, _config())
    onednn_linear.enable(onednn)
    onednn_calls = []
    real = onednn_linear._onednn
    monkeypatch.setattr(onednn_linear, "_onednn",
                        lambda *a, **k: (onednn_calls.append(1), real(*a, **k))[1])
    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 7, 4])
    x = torch.randn(16, 32, generator=generator)
    probs = torch.rand(16, generator=generator)
    grad = torch.randn(16, 32, generator=generator)
    results = []
    for model in (grouped, sequential):
        experts = model.decoder.layers[1].mlp.experts
        weights = {n: p for n, p in experts.named_parameters()}
        main_grads = torch.Generator().manual_seed(1)
        if fusion:
            for expert in experts.local_experts:
                for linear in (expert.linear_fc1, expert.linear_fc2):
                    linear.gradient_accumulation_fusion = True
                    linear.weight.main_grad = torch.randn(linear.weight.shape,
                                                          generator=main_grads)
                    linear.weight.grad_added_to_main_grad = False
        hidden, p = x.clone().requires_grad_(), probs.clone().requires_grad_()
        onednn_calls.clear()
        out, bias = experts(hidden, counts, p)
        assert bias is None
        out.backward(grad)
        if model is grouped:
            # a new row count per micro-batch: oneDNN would build a primitive for each
            assert onednn_calls == []
        name = type(out.grad_fn).__name__
        weight_grads = {n: (w.main_grad.clone() if fusion else w.grad) for n, w in
                        weights.items()}
        if fusion:
            assert all(w.grad_added_to_main_grad for w in weights.values())
        results.append((name, out.detach(), hidden.grad, p.grad, weight_grads))
    (name, out, g_hidden, g_probs, g_weights), (ref_name, *reference) = results
    assert name == "_GroupedExpertsFunctionBackward" and name != ref_name
    torch.testing.assert_close(out, reference[0], **TOL)
    torch.testing.assert_close(g_hidden, reference[1], **TOL)
    torch.testing.assert_close(g_probs, reference[2], **TOL)
    assert set(g_weights) == set(reference[3])
    for n in g_weights:
        torch.testing.assert_close(g_weights[n], reference[3][n], **TOL)


def test_whole_model_loss_and_gradients_equal_megatrons(gloo_group, monkeypatch):
    grouped, sequential = _models(monkeypatch, _config())
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).triu(1)
    losses = []
    for model in (grouped, sequential):
        loss = model(ids, torch.arange(16).expand(2, 16), mask, labels=ids).float().mean()
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], **TOL)
    reference = dict(sequential.named_parameters())
    for name, param in grouped.named_parameters():
        torch.testing.assert_close(param.grad, reference[name].grad, **TOL, msg=name)


def test_a_wrapped_expert_linear_runs_sequential_mlps_forward(gloo_group, monkeypatch):
    """An expert linear that is not megatron's own (a LoRA layer wraps it) must be called as
    a module: the grouped function would bypass it."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    grouped, _ = _models(monkeypatch, _config())
    experts = grouped.decoder.layers[1].mlp.experts
    calls = []

    class Wrapped(ColumnParallelLinear):
        def forward(self, *args, **kwargs):
            calls.append(1)
            return super().forward(*args, **kwargs)

    experts.local_experts[2].linear_fc1.__class__ = Wrapped
    hidden = torch.randn(6, 32, requires_grad=True)
    out, _ = experts(hidden, torch.tensor([2, 1, 2, 1]), torch.rand(6))
    assert calls == [1] and type(out.grad_fn).__name__ != "_GroupedExpertsFunctionBackward"


def test_cuda_runs_keep_megatrons_experts():
    from swift_mcore.runtime import cpu

    assert cpu.expert_module(_config()) is not None
    assert cpu.expert_module(type("Config", (), {"cuda": True})()) is None
