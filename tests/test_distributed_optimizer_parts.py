"""The pieces under --use_distributed_optimizer, one by one: the CPU port's parameter type
names (runtime/cpu/distributed_optimizer.py) and the placement of the gathered optimizer
state at the gradient buckets' padded offsets (runtime/mcore_adaptation.py). The runs
themselves: tests/checkpointing/test_distributed_optimizer.py."""

from types import SimpleNamespace

import torch

from swift_mcore.runtime import mcore_adaptation
from swift_mcore.runtime.cpu.distributed_optimizer import cpu_parameters_named_as_cuda


def test_cpu_parameters_answer_their_cuda_type_name_only_inside():
    param = torch.nn.Parameter(torch.zeros(2))
    with cpu_parameters_named_as_cuda():
        assert param.type() == "torch.cuda.FloatTensor"
        assert torch.zeros(2).type() == "torch.FloatTensor"  # plain tensors: torch's own
        assert param.type(torch.float64).dtype == torch.float64  # a conversion still is one
    assert param.type() == "torch.FloatTensor"
    assert "type" not in torch.nn.Parameter.__dict__


def test_gathered_state_is_placed_at_the_buckets_padded_offsets():
    """megatron gathers two buckets of 3 and 2 values (padded to 6 and 4) as 5 values in a
    row; each parameter's offset points into the padded buffer of 10."""
    buffer = SimpleNamespace(numel=10, buckets=[SimpleNamespace(offset=0, numel_unpadded=3),
                                                SimpleNamespace(offset=6, numel_unpadded=2)])
    gathered = torch.tensor([1.0, 2, 3, 4, 5])
    state = {0: {torch.float32: {"param": gathered, "exp_avg": gathered * 10,
                                 "numel_unpadded": 5}}}
    mcore_adaptation._pad_buckets(SimpleNamespace(buffers=[buffer]), state)
    world = state[0][torch.float32]
    assert world["param"].tolist() == [1, 2, 3, 0, 0, 0, 4, 5, 0, 0]
    assert world["exp_avg"].tolist() == [10, 20, 30, 0, 0, 0, 40, 50, 0, 0]
    assert world["numel_unpadded"] == 5
