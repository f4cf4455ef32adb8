"""Safe loading: no file of a checkpoint is unpickled with arbitrary globals.

megatron's torch_dist format stores three pickled things: ``common.pt`` (torch.save),
small per-layer ``_extra_state`` objects (torch.save inside the .distcp files) and torch
DCP's ``.metadata`` (a plain pickle). ``safe_loading()`` makes megatron's loader read the
first two with ``torch.load(weights_only=True)`` and the third with an unpickler that only
builds the DCP metadata classes, dtypes and sizes; anything else is refused with an error
naming it. Our own files (state, arguments, scheduler, RNG) are JSON.
"""

from __future__ import annotations

import contextlib
import enum
import io
import os
import pickle
from typing import Any

import torch

from ..errors import CheckpointError

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_EXTRA = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _EXTRA:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in _DCP_MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and (hasattr(obj, "__dataclass_fields__")
                                          or issubclass(obj, enum.Enum)):
                return obj
        raise pickle.UnpicklingError(
            f"refusing to build {module}.{name}: it is not one of the checkpoint metadata "
            f"types this loader allows")


def load_dcp_metadata(stream) -> Any:
    """Unpickle a torch DCP ``.metadata`` stream with the restricted unpickler."""
    return _MetadataUnpickler(stream).load()


def read_dcp_metadata(folder: str) -> Any:
    path = os.path.join(folder, ".metadata")
    try:
        with open(path, "rb") as fh:
            return load_dcp_metadata(fh)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {folder} has no .metadata file") from None
    except Exception as err:
        raise CheckpointError(f"checkpoint {folder}: .metadata cannot be read safely ({err})"
                              ) from None


def _safe_reader_class():
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(CachedMetadataFileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if self._cached_metadata is None:
                path = self._get_metadata_path(kwargs.get("rank"))
                with self.fs.create_stream(path, "rb") as fh:
                    metadata = load_dcp_metadata(fh)
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                self._cached_metadata = metadata
            return self._cached_metadata

    return SafeFileSystemReader


def _safe_planner_class(base):
    class SafeLoadPlanner(base):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict,
                            self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner


def safe_common_strategy():
    """megatron's common.pt loader with weights_only=True."""
    from megatron.core.dist_checkpointing.mapping import CheckpointingException
    from megatron.core.dist_checkpointing.strategies.common import (
        COMMON_STATE_FNAME,
        TorchCommonLoadStrategy,
    )

    class SafeCommonLoadStrategy(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            path = os.path.join(str(checkpoint_dir), COMMON_STATE_FNAME)
            try:
                return torch.load(path, map_location="cpu", weights_only=True)
            except FileNotFoundError as err:
                raise CheckpointingException(f"Common file {path} does not exist") from err

        def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
            raise CheckpointingException("torch_dist checkpoints keep objects in .distcp")

    return SafeCommonLoadStrategy()


@contextlib.contextmanager
def safe_loading():
    """Within this context megatron's torch_dist loader reads .metadata and the pickled
    objects inside .distcp files safely (see the module docstring)."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    saved_reader = mcore_torch._get_filesystem_reader
    saved_planner = mcore_torch.MCoreLoadPlanner
    reader_class = _safe_reader_class()

    def get_reader(checkpoint_dir, cache_metadata: bool = False):
        return reader_class(checkpoint_dir)

    mcore_torch._get_filesystem_reader = get_reader
    mcore_torch.MCoreLoadPlanner = _safe_planner_class(saved_planner)
    try:
        yield
    finally:
        mcore_torch._get_filesystem_reader = saved_reader
        mcore_torch.MCoreLoadPlanner = saved_planner
