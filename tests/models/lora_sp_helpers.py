"""One rank of a world of 2 (TP=2, --sequence_parallel on gloo): a column-parallel and a
row-parallel linear with LoRA adapters, on a slice of the sequence, against the same
computation on whole tensors; once as a decoder layer's linears, once as a routed expert's
(the tokens gathered over the TP ranks before it, its partial outputs reduce-scattered
after it, as megatron's token dispatcher does). Run on each rank by
tests/models/test_lora_sp.py (through two_ranks.py): {case: {what: largest difference}}."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

SEQ, HIDDEN, FFN, RANK, ALPHA = 8, 16, 24, 4, 8


def full_tensors() -> dict:
    """The whole weights, input and output gradient, the same on every rank."""
    g = torch.Generator().manual_seed(0)

    def draw(*shape):
        return torch.randn(*shape, generator=g) * 0.2  # values near 1 after two layers

    return dict(w1=draw(FFN, HIDDEN), a1=draw(RANK, HIDDEN), b1=draw(FFN, RANK),
                w2=draw(HIDDEN, FFN), a2=draw(RANK, FFN), b2=draw(HIDDEN, RANK),
                x=draw(SEQ, 1, HIDDEN), g=draw(SEQ, 1, HIDDEN))


def reference(t: dict) -> dict:
    """Output and gradients of the adapters and the input, on whole tensors."""
    leaves = {k: t[k].clone().requires_grad_(True) for k in ("a1", "b1", "a2", "b2", "x")}
    s = ALPHA / RANK
    x = leaves["x"]
    h = x @ t["w1"].T + s * (x @ leaves["a1"].T) @ leaves["b1"].T
    y = h @ t["w2"].T + s * (h @ leaves["a2"].T) @ leaves["b2"].T
    (y * t["g"]).sum().backward()
    return {"y": y.detach(), **{k: v.grad for k, v in leaves.items()}}


def adapted(base):
    from peft import LoraConfig

    from swift_mcore.models.lora_layer import LoraParallelLinear

    for p in base.parameters():
        p.requires_grad_(False)
    return LoraParallelLinear(base, "default", LoraConfig(r=RANK, lora_alpha=ALPHA,
                                                          lora_dropout=0.0),
                              r=RANK, lora_alpha=ALPHA)


def run_case(expert: bool, t: dict, ref: dict) -> dict:
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_non_tensor_model_parallel_grads,
    )
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2,
                               tensor_model_parallel_size=2, sequence_parallel=True,
                               use_cpu_initialization=True)
    tp = parallel_state.get_tensor_model_parallel_group()
    rank = tp.rank()
    kw = dict(is_expert=True, tp_group=parallel_state.get_expert_tensor_parallel_group()) \
        if expert else {}
    fc1 = adapted(ColumnParallelLinear(HIDDEN, FFN, config=config, init_method=nn.init.zeros_,
                                       bias=False, gather_output=False, **kw))
    fc2 = adapted(RowParallelLinear(FFN, HIDDEN, config=config, init_method=nn.init.zeros_,
                                    bias=False, input_is_parallel=True, skip_bias_add=True,
                                    **kw))
    rows, cols = slice(rank * FFN // 2, (rank + 1) * FFN // 2), slice(rank * SEQ // 2,
                                                                          (rank + 1) * SEQ // 2)
    with torch.no_grad():
        fc1.base_layer.weight.copy_(t["w1"][rows])
        fc1.lora_A["default"].weight.copy_(t["a1"])
        fc1.lora_B["default"].weight.copy_(t["b1"][rows])
        fc2.base_layer.weight.copy_(t["w2"][:, rows])
        fc2.lora_A["default"].weight.copy_(t["a2"][:, rows])
        fc2.lora_B["default"].weight.copy_(t["b2"])
    x = t["x"][cols].clone().requires_grad_(True)
    hidden = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True,
                                                  group=tp) if expert else x
    h, _ = fc1(hidden)
    y, _ = fc2(h)
    if expert:  # the dispatcher's combine: the partial outputs summed, sequence split
        y = reduce_scatter_to_sequence_parallel_region(y, group=tp)
    (y * t["g"][cols]).sum().backward()
    chunk = nn.ModuleDict(dict(fc1=fc1, fc2=fc2))
    chunk.ddp_config = SimpleNamespace(use_megatron_fsdp=False)
    _allreduce_non_tensor_model_parallel_grads([chunk], config, tp)
    ours = {"y": (y.detach(), ref["y"][cols]), "x": (x.grad, ref["x"][cols]),
            "a1": (fc1.lora_A["default"].weight.grad, ref["a1"]),
            "b1": (fc1.lora_B["default"].weight.grad, ref["b1"][rows]),
            "a2": (fc2.lora_A["default"].weight.grad, ref["a2"][:, rows]),
            "b2": (fc2.lora_B["default"].weight.grad, ref["b2"]),
            "merged fc1": (fc1.get_delta_weight("default"),
                           (t["b1"] @ t["a1"])[rows] * ALPHA / RANK),
            "merged fc2": (fc2.get_delta_weight("default"),
                           (t["b2"] @ t["a2"])[:, rows] * ALPHA / RANK)}
    return {k: (a - b).abs().max().item() for k, (a, b) in ours.items()}


def on_each_rank() -> dict:  # one rank of a world of 2: TP=2 (two_ranks.py)
    from swift_mcore.runtime.cpu import onednn_linear

    onednn_linear.enable(False)
    t = full_tensors()
    ref = reference(t)
    return {case: run_case(case == "expert", t, ref) for case in ("decoder", "expert")}
