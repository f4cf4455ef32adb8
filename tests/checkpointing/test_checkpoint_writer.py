"""The CPU checkpoint writer (runtime/cpu/checkpoint_writer.py) against megatron's own: the
same files byte for byte, and no copy of any tensor made before the writing starts."""

import io as io_module
import os

import torch

from swift_mcore.checkpointing.safe_load import load_dcp_metadata


def _state():
    """What a SwiGLU MLP saves: megatron's factory splits fc1 into two row views; besides a
    whole tensor and a column slice (a view whose clone must keep its layout)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    gen = torch.Generator().manual_seed(0)
    fc1 = torch.randn(2 * 48, 32, generator=gen)
    fc2 = torch.randn(32, 48, generator=gen)
    wide = torch.randn(16, 40, generator=gen)
    state = {
        "fc1": apply_swiglu_sharded_factory(
            ShardedTensor.from_rank_offsets("mlp.fc1", fc1, replica_id=0), ()),
        "fc2": ShardedTensor.from_rank_offsets("mlp.fc2", fc2, replica_id=0),
        "cols": ShardedTensor.from_rank_offsets("cols", wide[:, 8:24], replica_id=0),
        "plain": {"note": "common data"},
    }
    return state, [fc1, fc2, wide]


def _save(folder, writer, monkeypatch, seen=None):
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    from swift_mcore.checkpointing import io

    if seen is not None:  # every tensor the buckets hold once prepare_write_data is done
        class Spy(writer):
            def prepare_write_data(self, plan, planner):
                super().prepare_write_data(plan, planner)
                for _, _, (_, tensors) in self.write_buckets:
                    seen.extend(t for _, t in getattr(tensors, "pairs", tensors))
        writer = Spy
    monkeypatch.setattr(torch_strategy, "FileSystemWriterAsync", writer)
    state, sources = _state()
    os.makedirs(folder)
    io.save(state, str(folder))
    return sources


def _files(folder):
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as fh:
            out[name] = fh.read()
    # the project's restricted unpickler, as every .metadata read (checkpointing/safe_load.py)
    metadata = load_dcp_metadata(io_module.BytesIO(out.pop(".metadata")))
    metadata.storage_meta = None  # the folder's path and a fresh uuid per save
    return out, metadata


def test_lazy_clone_writer_writes_megatrons_files(gloo_group, tmp_path, monkeypatch):
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    from swift_mcore.runtime.cpu.checkpoint_writer import writer_class

    _save(tmp_path / "megatron", FileSystemWriterAsync, monkeypatch)
    _save(tmp_path / "lazy", writer_class(), monkeypatch)
    theirs, ours = _files(tmp_path / "megatron"), _files(tmp_path / "lazy")
    assert sorted(ours[0]) == sorted(theirs[0]) and any(n.endswith(".distcp") for n in ours[0])
    for name in theirs[0]:
        assert ours[0][name] == theirs[0][name], name
    assert vars(ours[1]) == vars(theirs[1])


def _shares_a_source(tensor, sources):
    start = tensor.untyped_storage().data_ptr()
    return any(s.untyped_storage().data_ptr() == start for s in sources)


def test_no_tensor_is_copied_before_writing(gloo_group, tmp_path, monkeypatch):
    """megatron's writer clones the fc1 halves and the column slice up front (the copy this
    writer exists to avoid); this one hands the writer processes the model's own storage."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    from swift_mcore.runtime.cpu.checkpoint_writer import writer_class

    seen = []
    sources = _save(tmp_path / "megatron", FileSystemWriterAsync, monkeypatch, seen)
    copied = [t for t in seen if not _shares_a_source(t, sources)]
    assert sum(t.numel() for t in copied) == 2 * 48 * 32 + 16 * 16

    seen.clear()
    sources = _save(tmp_path / "lazy", writer_class(), monkeypatch, seen)
    assert len(seen) == 4 and all(_shares_a_source(t, sources) for t in seen)


def test_install_gives_the_save_strategy_the_lazy_writer():
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    from swift_mcore.runtime.cpu import checkpoint_writer

    checkpoint_writer.install()
    assert torch_strategy.FileSystemWriterAsync is checkpoint_writer.writer_class()
