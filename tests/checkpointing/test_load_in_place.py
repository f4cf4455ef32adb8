"""A SwiGLU weight loads into the parameter itself (checkpointing/io.py
merge_swiglu_halves_in_place), not into a second, concatenated copy of it."""

import os

import torch


def _state(fc1):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    return {"fc1": apply_swiglu_sharded_factory(
        ShardedTensor.from_rank_offsets("mlp.fc1", fc1, replica_id=0), ())}


def test_swiglu_halves_load_into_the_parameter_itself(gloo_group, tmp_path):
    from swift_mcore.checkpointing import io

    saved = torch.randn(2 * 24, 16, generator=torch.Generator().manual_seed(0))
    os.makedirs(tmp_path / "ckpt")
    io.save(_state(saved.clone()), str(tmp_path / "ckpt"))

    target = torch.zeros_like(saved)
    loaded = io.load(_state(target), str(tmp_path / "ckpt"))["fc1"]
    assert loaded is target  # megatron's merge would be a new tensor: torch.cat of the halves
    assert torch.equal(target, saved)


def test_pieces_that_are_not_the_parameters_halves_are_concatenated():
    from swift_mcore.checkpointing.io import _merged

    data = torch.arange(12.0).reshape(6, 2)
    halves = list(torch.chunk(data, 2))
    assert _merged(data, torch.cat, halves) is data
    swapped = _merged(data, torch.cat, halves[::-1])  # not in order: megatron's own cat
    assert swapped is not data and torch.equal(swapped, torch.cat(halves[::-1]))
    copies = [h.clone() for h in halves]
    merged = _merged(data, torch.cat, copies)
    assert merged is not data and torch.equal(merged, data)
