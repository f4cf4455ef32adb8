"""runtime/cpu/local_dispatch.py: with every expert on this rank, the CPU MoE layers'
dispatcher gives megatron's alltoall dispatcher's outputs and gradients, and runs megatron's
own methods wherever experts span ranks or tokens are dropped."""

import torch
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from swift_mcore.arguments import parse_args
from swift_mcore.run_config import resolve
from swift_mcore.runtime.cpu.local_dispatch import LocalTokenDispatcher, use_local_dispatch

TOL = dict(rtol=1e-6, atol=1e-6)


def _config(*extra):
    return resolve(parse_args([
        "--num_layers", "2", "--micro_batch_size", "2", "--global_batch_size", "2",
        "--hidden_size", "32", "--num_attention_heads", "4", "--seq_length", "16",
        "--num_experts", "4", "--moe_router_topk", "2", "--ffn_hidden_size", "24",
        "--moe_aux_loss_coeff", "0.01", *extra]),
        world_size=1, cuda=False).complete(256, None)


def _models(config):
    """The same model (same seed) twice: the first with the local dispatcher."""
    from swift_mcore.models import gpt
    from swift_mcore.runtime.seed import set_seed

    set_seed(1)
    local = gpt.build_model(config)[0]
    set_seed(1)
    reference = gpt.build_model(config)[0]
    assert use_local_dispatch(local) == 2
    return local, reference


def _calls(monkeypatch):
    """Records each call of megatron's own dispatcher methods that the local one replaces."""
    calls = []
    for name in ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess",
                 "combine_preprocess", "token_combine", "combine_postprocess"):
        real = getattr(MoEAlltoAllTokenDispatcher, name)
        monkeypatch.setattr(MoEAlltoAllTokenDispatcher, name,
                            lambda self, *a, _real=real, _name=name, **k:
                            (calls.append(_name), _real(self, *a, **k))[1])
    return calls


def _run(model, ids):
    loss = model(ids, torch.arange(16).expand(2, 16), None, labels=ids).float().mean()
    loss.backward()
    return loss.detach()


def test_whole_model_loss_and_gradients_equal_megatrons_dispatcher(gloo_group, monkeypatch):
    local, reference = _models(_config())
    for model, cls in ((local, LocalTokenDispatcher), (reference, MoEAlltoAllTokenDispatcher)):
        assert all(type(layer.mlp.token_dispatcher) is cls for layer in model.decoder.layers)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    calls = _calls(monkeypatch)
    loss = _run(local, ids)
    assert calls == []  # none of megatron's cross-rank steps ran
    reference_loss = _run(reference, ids)
    assert len(calls) == 12
    torch.testing.assert_close(loss, reference_loss, **TOL)
    expected = dict(reference.named_parameters())
    for name, param in local.named_parameters():
        torch.testing.assert_close(param.grad, expected[name].grad, **TOL, msg=name)


def test_the_layer_equals_megatrons_with_a_token_dropped_expert(gloo_group):
    """One MoE layer, every token routed away from expert 3: the same output, input and
    router gradients, tokens per expert as megatron counts them."""
    local, reference = _models(_config())
    results = []
    generator = torch.Generator().manual_seed(2)
    x = torch.rand(16, 2, 32, generator=generator)  # positive: expert 3's logit far below
    grad = torch.randn(16, 2, 32, generator=generator)
    for model in (local, reference):
        layer = model.decoder.layers[0].mlp
        with torch.no_grad():
            layer.router.weight[3] = -100.0  # expert 3 never in the top 2
        counts = []
        experts_forward = layer.experts.forward
        layer.experts.forward = (lambda h, n, p: (counts.append(n.tolist()),
                                                  experts_forward(h, n, p))[1])
        hidden = x.clone().requires_grad_()
        out, _ = layer(hidden)
        out.backward(grad)
        results.append((counts, out.detach(), hidden.grad, layer.router.weight.grad))
    (counts, *values), (reference_counts, *expected) = results
    assert counts == reference_counts and counts[0][3] == 0 and sum(counts[0]) == 64
    for value, want in zip(values, expected):
        torch.testing.assert_close(value, want, **TOL)


def test_token_dropping_runs_megatrons_dispatcher(gloo_group, monkeypatch):
    """With a capacity factor (set on the built model: no flag offers it yet) megatron's
    dispatcher sizes its output from the dropped routing map: its own methods run."""
    local, _ = _models(_config())
    local.config.moe_expert_capacity_factor = 1.0
    calls = _calls(monkeypatch)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    _run(local, ids)
    assert len(calls) == 12


def test_other_dispatchers_and_cuda_runs_keep_megatrons(gloo_group):
    from swift_mcore.models import gpt
    from swift_mcore.runtime import cpu

    model = gpt.build_model(_config())[0]
    cpu.after_ddp([model], type("Config", (), {"cuda": True})())
    assert type(model.decoder.layers[0].mlp.token_dispatcher) is MoEAlltoAllTokenDispatcher
    model = gpt.build_model(_config("--moe_token_dispatcher_type", "allgather"))[0]
    assert use_local_dispatch(model) == 0
