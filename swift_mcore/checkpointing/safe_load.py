"""Safe loading: no file of a checkpoint is unpickled with arbitrary globals.

megatron's torch_dist format stores three pickled things: ``common.pt`` (torch.save),
the tensors and small per-layer ``_extra_state`` objects inside the .distcp files
(torch.save each) and torch DCP's ``.metadata`` (a plain pickle). ``safe_loading()`` makes
megatron's loader read the first two with ``torch.load(weights_only=True)`` restricted to
torch's own tensor and container types plus ``TORCH_LOAD_EXTRA`` (the safe globals other
libraries register, megatron's included, do not apply), and the third with an unpickler
that only builds the DCP metadata classes, dtypes and sizes. ``common.pt`` also admits
Megatron-LM's ``args`` Namespace and megatron-core's enums (``common_pt_extra``), and
Megatron-LM's ``rng_state`` object numpy's uint32 state array (``rng_state_extra``).
Anything else is refused with a one-line CheckpointError naming the file and the refused
type. Our own files (state,
arguments, scheduler, RNG) are JSON.
"""

from __future__ import annotations

import contextlib
import enum
import io
import os
import pickle
import re
from typing import Any, Iterator, List, Optional

import torch

from ..errors import ArgumentError, CheckpointError
from ..input_files import inside, open_regular

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
    """Unpickle a torch DCP ``.metadata`` stream with the restricted unpickler; anything but
    a DCP Metadata object is refused."""
    from torch.distributed.checkpoint.metadata import Metadata

    metadata = _MetadataUnpickler(stream).load()
    if not isinstance(metadata, Metadata) or not isinstance(
            getattr(metadata, "state_dict_metadata", None), dict):
        raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not torch DCP "
                                     f"checkpoint metadata")
    return metadata


def read_dcp_metadata(folder: str) -> Any:
    path = os.path.join(folder, ".metadata")
    if not os.path.lexists(path):
        raise CheckpointError(f"checkpoint {folder} has no .metadata file")
    try:
        with open_regular(path, "rb", f"checkpoint {folder}: .metadata") as fh:
            metadata = load_dcp_metadata(fh)
    except ArgumentError as err:  # a FIFO or device: refused before it is read
        raise CheckpointError(str(err)) from None
    except Exception as err:
        raise CheckpointError(f"checkpoint {folder}: .metadata: "
                              f"{_reason(err, METADATA_ALLOWED)}") from None
    check_storage_paths(metadata, folder)
    return metadata


def check_storage_paths(metadata: Any, folder: str) -> None:
    """Every file torch DCP's ``.metadata`` names for its data stays inside ``folder``."""
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        try:
            inside(str(folder), getattr(info, "relative_path", None),
                   f"checkpoint {folder}: .metadata")
        except ArgumentError as err:
            raise CheckpointError(str(err)) from None


def _regular_file_system(folder: str):
    """torch DCP's file system whose reads open regular files only (a FIFO named like a
    .distcp file would block ``open``): anything else is a CheckpointError naming it."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class RegularFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode: str):
            if set(mode) - set("rb"):
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            where = f"checkpoint {folder}: {os.path.relpath(str(path), str(folder))}"
            try:
                stream = open_regular(str(path), mode, where)
            except ArgumentError as err:
                raise CheckpointError(str(err)) from None
            with stream:
                yield stream

    return RegularFileSystem()



# ---- torch.load: torch's own types and this list, nothing registered by anyone else --------
# Beyond torch's built-in weights_only set (tensors, storages, dtypes, torch.Size, numbers,
# strings, lists, tuples, dicts, OrderedDict), which is all swift-mcore's checkpoints hold:
# older Transformer Engine versions keep a layer's _extra_state as a BytesIO.
TORCH_LOAD_EXTRA = (io.BytesIO,)
TORCH_LOAD_ALLOWED = "tensors, numbers, strings, lists, tuples, dicts"
COMMON_PT_ALLOWED = TORCH_LOAD_ALLOWED + ", argparse.Namespace, megatron-core's enums, signal.Signals"


def common_pt_extra() -> tuple:
    """What ``common.pt`` may hold beyond TORCH_LOAD_EXTRA: Megatron-LM (and ms-swift, which
    saves through it) pickles its ``args`` there, an ``argparse.Namespace`` whose fields are
    plain values, megatron-core's enums (``ModelType``, ``AttnBackend``...) and
    ``signal.Signals``. An enum is rebuilt by looking its value up among its members; a
    Namespace by setting its ``__dict__``: neither runs code of the file's choosing.
    Explicit classes only (not "any enum"), computed from megatron-core's two enum modules."""
    import argparse
    import enum
    import signal

    from megatron.core import enums as core_enums
    from megatron.core.transformer import enums as transformer_enums

    found = [argparse.Namespace, signal.Signals]
    for module in (core_enums, transformer_enums):
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, enum.Enum) \
                    and value.__module__ == module.__name__:
                found.append(value)
    return tuple(found)
METADATA_ALLOWED = "torch DCP's metadata classes, dtypes, sizes"
_ADVICE = ("weights_only", "weights only", "safe_globals", "check the documentation",
           "trusted source", "allowlist")


RNG_STATE_KEY = "rng_state"
RNG_STATE_ALLOWED = TORCH_LOAD_ALLOWED + ", numpy uint32 arrays"


def rng_state_extra() -> tuple:
    """What Megatron-LM's ``rng_state`` object may hold beyond TORCH_LOAD_EXTRA: numpy's
    MT19937 state, a uint32 array (``np.random.get_state()``), rebuilt by numpy's array
    reconstructor from its dtype and bytes. Only the uint32 dtype class is admitted, so no
    object array (whose elements would be unpickled) can be built."""
    import numpy as np
    from numpy._core import multiarray

    return ((multiarray._reconstruct, "numpy._core.multiarray._reconstruct"), np.ndarray,
            np.dtype, type(np.dtype(np.uint32)))


@contextlib.contextmanager
def only_allowed_globals(extra: tuple = ()) -> Iterator[None]:
    """While inside, ``torch.load(weights_only=True)`` accepts torch's built-in types,
    TORCH_LOAD_EXTRA and ``extra`` only: the globals registered with
    torch.serialization.add_safe_globals (megatron registers argparse.Namespace,
    SimpleNamespace, PosixPath, numpy arrays, its configs...) are set aside and put back
    afterwards."""
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals([*TORCH_LOAD_EXTRA, *extra])
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(saved)


def _reason(err: BaseException, allowed: str = TORCH_LOAD_ALLOWED) -> str:
    """One line on why a pickled thing was not loaded: the refused global when there is one,
    never torch's advice to load with weights_only=False."""
    text = str(err)
    found = re.search(r"GLOBAL ([\w.]+)", text) or re.search(
        r"(?:refusing to build|unsupported class|unrecognized function) ([\w.<>]+)", text)
    if found:
        return (f"refusing to unpickle {found.group(1).rstrip('.')} (not one of the types "
                f"swift-mcore loads from a checkpoint: {allowed})")
    lines: List[str] = []
    for line in text.splitlines():
        line = line.split("Please ")[0].strip()
        if line and not any(word in line.lower() for word in _ADVICE):
            lines.append(line)
    detail = f"{type(err).__name__}: {lines[0][:300]}" if lines else type(err).__name__
    return f"not a readable torch.save file ({detail})"


def torch_load(source, where: str, extra: tuple = (), allowed: str = TORCH_LOAD_ALLOWED
               ) -> Any:
    """``torch.load`` of ``source`` (a path or a stream) with the allowed types (and
    ``extra``) only; any failure is a one-line CheckpointError starting with ``where``."""
    try:
        with only_allowed_globals(extra):
            return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(f"{where}: {_reason(err, allowed)}") from None


def load_failure(err: BaseException) -> BaseException:
    """The exception behind torch DCP's CheckpointException (a BaseException that holds each
    rank's exception and its traceback text), else ``err``."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict):
        for value in failures.values():
            inner = value[0] if isinstance(value, tuple) else value
            if isinstance(inner, BaseException):
                return load_failure(inner)
    return err


def _safe_reader_class():
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(CachedMetadataFileSystemReader):
        _reading: Optional[Any] = None  # the _StorageInfo of the item being read

        def __init__(self, path):
            super().__init__(path)
            self.fs = _regular_file_system(self.path)

        def read_metadata(self, *args, **kwargs):
            if self._cached_metadata is None:
                path = self._get_metadata_path(kwargs.get("rank"))
                try:
                    with self.fs.create_stream(path, "rb") as fh:
                        metadata = load_dcp_metadata(fh)
                except CheckpointError:
                    raise
                except Exception as err:
                    raise CheckpointError(f"checkpoint {self.path}: .metadata: "
                                          f"{_reason(err, METADATA_ALLOWED)}") from None
                check_storage_paths(metadata, self.path)
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                self._cached_metadata = metadata
            return self._cached_metadata

        def _slice_file(self, file, sinfo):
            self._reading = sinfo
            return super()._slice_file(file, sinfo)

        def read_data(self, plan, planner):
            """torch's reader (each tensor and object torch.load'ed, within the allowed
            types); a failure names the .distcp file, the item and the refused type."""
            self._reading = None
            try:
                return super().read_data(plan, planner)
            except CheckpointError:
                raise  # a file that is not a regular one, named by the file system
            except Exception as err:
                raise CheckpointError(f"checkpoint {self.path}: {self._item()}: "
                                      f"{_reason(err)}") from None

        def _item(self) -> str:
            sinfo = self._reading
            if sinfo is None:
                return "reading the .distcp files"
            fqn = next((index.fqn for index, info in self.storage_data.items()
                        if info is sinfo), "?")
            return f"{sinfo.relative_path} (item {fqn} at byte {sinfo.offset})"

    return SafeFileSystemReader


def _safe_planner_class(base):
    class SafeLoadPlanner(base):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            # within safe_loading(): only the allowed types (the reader names the item);
            # Megatron-LM's rng_state also holds numpy's uint32 state array.
            if read_item.dest_index.fqn.split("/")[0] == RNG_STATE_KEY:
                with only_allowed_globals(rng_state_extra()):
                    obj = torch.load(value, map_location="cpu", weights_only=True)
            else:
                obj = torch.load(value, map_location="cpu", weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict,
                            self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner


def safe_common_strategy():
    """megatron's common.pt loader with weights_only=True and the allowed types only (for
    common.pt: ``common_pt_extra()`` too)."""
    from megatron.core.dist_checkpointing.mapping import CheckpointingException
    from megatron.core.dist_checkpointing.strategies.common import (
        COMMON_STATE_FNAME,
        TorchCommonLoadStrategy,
    )

    class SafeCommonLoadStrategy(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            path = os.path.join(str(checkpoint_dir), COMMON_STATE_FNAME)
            if not os.path.lexists(path):
                raise CheckpointingException(f"Common file {path} does not exist")
            where = f"checkpoint {checkpoint_dir}: {COMMON_STATE_FNAME}"
            try:
                stream = open_regular(path, "rb", where)
            except ArgumentError as err:  # a FIFO or device would block torch.load
                raise CheckpointError(str(err)) from None
            with stream:
                return torch_load(stream, where, extra=common_pt_extra(),
                                  allowed=COMMON_PT_ALLOWED)

        def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
            raise CheckpointingException("torch_dist checkpoints keep objects in .distcp")

    return SafeCommonLoadStrategy()


@contextlib.contextmanager
def safe_loading():
    """Within this context megatron's torch_dist loader reads .metadata, common.pt and the
    tensors and objects inside .distcp files safely (see the module docstring)."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    saved_reader = mcore_torch._get_filesystem_reader
    saved_planner = mcore_torch.MCoreLoadPlanner
    reader_class = _safe_reader_class()

    def get_reader(checkpoint_dir, cache_metadata: bool = False):
        return reader_class(checkpoint_dir)

    mcore_torch._get_filesystem_reader = get_reader
    mcore_torch.MCoreLoadPlanner = _safe_planner_class(saved_planner)
    try:
        with only_allowed_globals():
            yield
    finally:
        mcore_torch._get_filesystem_reader = saved_reader
        mcore_torch.MCoreLoadPlanner = saved_planner
