"""The LoRA layer's forward and backward against peft's arithmetic, base(x) + B(A(drop(x)))*s,
on megatron's column- and row-parallel linears: speed-ups of the layer keep its numbers."""

import math

import pytest
import torch
from peft import LoraConfig


def lora_linear(row_parallel, r, alpha, dropout, rslora=False):
    from megatron.core import tensor_parallel
    from megatron.core.transformer import TransformerConfig

    from swift_mcore.models.lora_layer import LoraParallelLinear

    config = TransformerConfig(num_layers=1, hidden_size=24, num_attention_heads=2,
                               use_cpu_initialization=True)
    init = torch.nn.init.normal_
    torch.manual_seed(0)
    if row_parallel:
        base = tensor_parallel.RowParallelLinear(24, 40, config=config, init_method=init,
                                                 bias=False, input_is_parallel=True,
                                                 skip_bias_add=True)
    else:
        base = tensor_parallel.ColumnParallelLinear(24, 40, config=config, init_method=init,
                                                    bias=False, gather_output=False,
                                                    skip_bias_add=True)
    base.weight.requires_grad_(False)
    layer = LoraParallelLinear(base, "default", LoraConfig(lora_dropout=dropout,
                                                          use_rslora=rslora),
                               r=r, lora_alpha=alpha)
    layer.init_adapter(seed=1)
    with torch.no_grad():  # B = 0 would hide how the product is scaled
        layer.lora_B["default"].weight.normal_(0, 0.5,
                                               generator=torch.Generator().manual_seed(2))
    return layer


def peft_arithmetic(layer, x, dropout):
    base = layer.get_base_layer().weight
    a = layer.lora_A["default"].weight.detach().clone().requires_grad_()
    b = layer.lora_B["default"].weight.detach().clone().requires_grad_()
    drop = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()
    out = x @ base.t() + (drop(x) @ a.t() @ b.t()) * layer.scaling["default"]
    return out, a, b


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("onednn", [False, True])
@pytest.mark.parametrize("row_parallel", [False, True])
@pytest.mark.parametrize("r, alpha, rslora, exact", [
    (8, 32, False, True),    # alpha/r = 4: scaling by a power of two commutes exactly
    (3, 7, True, False),     # 7/sqrt(3): within float rounding
])
def test_forward_and_gradients_equal_peft(gloo_group, monkeypatch, fused, onednn, row_parallel,
                                          r, alpha, rslora, exact):
    """fused: B's product added into the base output (low_rank_add.py), else B's module."""
    from swift_mcore.models import low_rank_add
    from swift_mcore.runtime.cpu import onednn_linear

    if onednn and not onednn_linear.available():
        pytest.skip("no oneDNN linear in this torch")
    calls = []
    add = low_rank_add.add_low_rank
    monkeypatch.setattr(low_rank_add, "add_low_rank",
                        lambda *a: calls.append(1) or add(*a))
    if not fused:
        monkeypatch.setattr(low_rank_add, "plain_weight", lambda *a: None)
    dropout = 0.25
    layer = lora_linear(row_parallel, r, alpha, dropout, rslora)
    assert layer.scaling["default"] == (alpha / math.sqrt(r) if rslora else alpha / r)
    x = torch.randn(2, 5, 24, generator=torch.Generator().manual_seed(3))
    grad = torch.randn(2, 5, 40, generator=torch.Generator().manual_seed(4))
    onednn_linear.enable(onednn)
    try:
        mine = x.clone().requires_grad_()
        torch.manual_seed(5)  # the same dropout mask for both
        out, bias = layer(mine)
        out.backward(grad)
        theirs = x.clone().requires_grad_()
        torch.manual_seed(5)
        expected, a, b = peft_arithmetic(layer, theirs, dropout)
        expected.backward(grad)
    finally:
        onednn_linear.enable(False)
    assert bias is None
    assert len(calls) == fused
    pairs = [(out, expected), (mine.grad, theirs.grad),
             (layer.lora_A["default"].weight.grad, a.grad),
             (layer.lora_B["default"].weight.grad, b.grad)]
    for got, want in pairs:
        # oneDNN and MKL sum in other orders: equal to rounding, not bit for bit
        if exact and not onednn:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
