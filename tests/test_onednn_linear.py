"""runtime/cpu/onednn_linear.py: megatron's linears on oneDNN give megatron's outputs and
gradients, take the fast path only where it applies, and --cpu_matmul decides it once."""

import pytest
import torch

from swift_mcore.arguments import RunArguments
from swift_mcore.errors import ArgumentError
from swift_mcore.run_config import resolve
from swift_mcore.runtime.cpu import onednn_linear

pytestmark = pytest.mark.skipif(not onednn_linear.available(),
                                reason="this torch build has no oneDNN linear")


@pytest.fixture
def onednn_calls(gloo_group, monkeypatch):
    """Counts the products oneDNN computes; the path is off again afterwards."""
    calls = []
    real = onednn_linear._onednn
    monkeypatch.setattr(onednn_linear, "_onednn",
                        lambda *a, **k: (calls.append(a[1].shape), real(*a, **k))[1])
    yield calls
    onednn_linear.enable(False)


def _layers():
    from megatron.core.tensor_parallel import layers

    return layers


def _run_linear(on, shape, *, bias, fusion, allreduce_dgrad=False, dtype=torch.float32,
                sequence_parallel=False):
    """One forward and backward through megatron's linear_with_grad_accumulation_and_async_
    allreduce with oneDNN on or off: the output and every gradient it produced."""
    onednn_linear.enable(on)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, 48, generator=generator, dtype=dtype).requires_grad_()
    weight = torch.randn(40, 48, generator=generator, dtype=dtype).requires_grad_()
    b = torch.randn(40, generator=generator, dtype=dtype).requires_grad_() if bias else None
    if fusion:
        # as DDP leaves it: main_grad already holds an earlier micro-batch's gradient
        weight.main_grad = torch.randn(40, 48, generator=generator, dtype=dtype)
        weight.grad_added_to_main_grad = False
    out = _layers().linear_with_grad_accumulation_and_async_allreduce(
        x, weight, b, gradient_accumulation_fusion=fusion, allreduce_dgrad=allreduce_dgrad,
        sequence_parallel=sequence_parallel)
    out.backward(torch.randn(out.shape, generator=generator, dtype=dtype))
    result = {"out": out.detach(), "x": x.grad, "bias": None if b is None else b.grad}
    if fusion:
        result["main_grad"] = weight.main_grad
        assert weight.grad_added_to_main_grad is True
    else:
        result["weight"] = weight.grad
    return result


@pytest.mark.parametrize("shape,bias,fusion,allreduce_dgrad", [
    ((7, 3), False, True, False),   # [seq, batch, hidden] as megatron's layers pass it
    ((7, 3), True, False, True),    # a bias, no DDP, the TP all-reduce of the input grad
    ((21,), True, True, True),
])
def test_outputs_and_gradients_equal_megatrons(onednn_calls, shape, bias, fusion,
                                               allreduce_dgrad):
    ours = _run_linear(True, shape, bias=bias, fusion=fusion, allreduce_dgrad=allreduce_dgrad)
    assert onednn_calls == [(40, 48), (48, 40)]  # the forward, then the input gradient
    megatron = _run_linear(False, shape, bias=bias, fusion=fusion,
                           allreduce_dgrad=allreduce_dgrad)
    assert len(onednn_calls) == 2  # off: megatron's torch.matmul did it all
    assert ours["out"].shape == megatron["out"].shape == (*shape, 40)
    assert ours.keys() == megatron.keys()
    for name, value in ours.items():
        if value is None:
            assert megatron[name] is None, name
            continue
        assert value.abs().sum() > 0, name
        torch.testing.assert_close(value, megatron[name], rtol=1e-5, atol=1e-5, msg=name)


def test_the_frozen_linear_keeps_only_the_weight_and_gives_megatrons_input_gradient(
        onednn_calls):
    def run(on):
        onednn_linear.enable(on)
        generator = torch.Generator().manual_seed(5)
        x = torch.randn(6, 2, 48, generator=generator).requires_grad_()
        weight = torch.randn(40, 48, generator=generator)
        out = _layers().linear_with_frozen_weight(
            x, weight, None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
            sequence_parallel=False, tp_group=None)
        out.backward(torch.ones_like(out))
        return out.detach(), x.grad

    (out, grad), (reference_out, reference_grad) = run(True), run(False)
    assert onednn_calls == [(40, 48), (48, 40)]
    torch.testing.assert_close(out, reference_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, reference_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["bfloat16", "sequence_parallel", "disabled"])
def test_other_cases_go_to_megatrons_function(onednn_calls, monkeypatch, case):
    layers = _layers()
    original = layers.LinearWithGradAccumulationAndAsyncCommunication._swift_mcore_original
    handed = []
    monkeypatch.setattr(original, "apply",
                        lambda *a: handed.append(1) or torch.zeros(1))
    onednn_linear.enable(case != "disabled")
    x = torch.randn(4, 2, 8, dtype=torch.bfloat16 if case == "bfloat16" else torch.float32)
    layers.LinearWithGradAccumulationAndAsyncCommunication.apply(
        x, torch.randn(6, 8, dtype=x.dtype), None, False, False,
        case == "sequence_parallel", None, 0, None)
    assert handed == [1] and onednn_calls == []


def test_activate_installs_the_stand_ins_once(gloo_group):
    from swift_mcore.runtime.cpu import cpu_compat

    layers = _layers()
    linear, frozen = (layers.LinearWithGradAccumulationAndAsyncCommunication,
                      layers.LinearWithFrozenWeight)
    assert linear._swift_mcore_original.__name__ == \
        "LinearWithGradAccumulationAndAsyncCommunication"
    assert frozen._swift_mcore_original.__name__ == "LinearWithFrozenWeight"
    cpu_compat._install_onednn_linear()  # a second install would wrap the stand-ins
    assert layers.LinearWithGradAccumulationAndAsyncCommunication is linear
    assert layers.LinearWithFrozenWeight is frozen


def test_cpu_matmul_is_decided_once(monkeypatch):
    assert onednn_linear.choose("auto") == "onednn"
    assert onednn_linear.choose("mkl") == "mkl"
    default = resolve(RunArguments(), world_size=1, cuda=False)
    assert default.cpu_matmul == "onednn" and "linear layers on oneDNN" in default.describe()
    mkl = resolve(RunArguments.from_flags(cpu_matmul="mkl"), world_size=1, cuda=False)
    assert "linear layers on torch.matmul (MKL)" in mkl.describe()
    gpu = resolve(RunArguments(), world_size=1, cuda=True, transformer_engine=False)
    assert gpu.cpu_matmul is None and "linear layers" not in gpu.describe()
    explicit = resolve(RunArguments.from_flags(cpu_matmul="onednn"), world_size=1,
                       cuda=True, transformer_engine=False)
    assert explicit.cpu_matmul is None  # nothing to choose on a GPU
    monkeypatch.setattr(onednn_linear, "available", lambda: False)
    assert onednn_linear.choose("auto") == "mkl"
    with pytest.raises(ArgumentError, match="--cpu_matmul onednn: this torch build"):
        resolve(RunArguments.from_flags(cpu_matmul="onednn"), world_size=1, cuda=False)


@pytest.mark.parametrize("choice", ["auto", "mkl"])
def test_training_multiplies_where_cpu_matmul_says(onednn_calls, tmp_path, choice):
    from in_process import train_in_process

    out = train_in_process(tmp_path / "run", "--train_iters", "1", "--no_save",
                           "--cpu_matmul", choice, command="pt").stdout
    assert ("linear layers on oneDNN" if choice == "auto" else "on torch.matmul (MKL)") in out
    if choice == "auto":
        assert len(onednn_calls) > 0 and onednn_linear.enabled()
    else:
        assert onednn_calls == [] and not onednn_linear.enabled()
