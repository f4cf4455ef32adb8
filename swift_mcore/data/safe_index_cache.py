"""Makes megatron's dataset index caches load without unpickling, and only as integer arrays.

megatron-core 0.16.1 writes and reads its dataset index caches with
``numpy.save/load(..., allow_pickle=True)``: GPTDataset's document, sample and shuffle
indices (gpt_dataset.py 311-318, 549-551, 579-599) and BlendedDataset's dataset and
dataset-sample indices (blended_dataset.py 99-103, 203-204, 223-234). ``numpy.load`` with
``allow_pickle=True`` unpickles a file that is not an ``.npy`` array, so a pickle planted in
a cache folder (``output_dir/data_cache`` or a shared ``--data_cache_path``) would run as
code when a run starts.

``activate()`` gives each of those two modules a private ``numpy`` name (the approach of
runtime/cpu/cpu_compat.py, but active on CPU and GPU alike) that is numpy itself except:

* ``load`` first checks the file (``check_index_file``): the ``.npy`` magic and version, a
  header parsed as a literal (never evaluated), the dtype, rank and shape this kind of
  index has, C order, and a file size equal to what the header describes; only then does it
  read it, with ``allow_pickle=False``. A file that fails is refused with an ArgumentError
  naming it (exit code 2), never rebuilt: see ``docs/data.md``, "The caches".
* ``save`` writes with ``allow_pickle=False`` under a temporary name and renames into place,
  so an interrupted build never leaves a truncated index file behind for the next start to
  refuse (megatron treats the cache as hit when the files exist).

indexed_dataset.py (the .bin/.idx reader) only memory-maps raw bytes and needs nothing.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Tuple

import numpy

from ..errors import ArgumentError
from ..runtime.mcore_adaptation import ModuleProxy, require_tested_version


# module -> the lines that load or save index caches with allow_pickle=True (0.16.1)
PATCHED_MODULES = {
    "megatron.core.datasets.gpt_dataset": "document/sample/shuffle index (311-318, 549-599)",
    "megatron.core.datasets.blended_dataset": "dataset/dataset-sample index (99-103, 203-234)",
}

# The file's kind (the name's last part, after megatron's "<hash>-<class>-<split>-") ->
# (rank, allowed dtypes). Only these are read; each is what megatron-core 0.16.1 builds:
# _build_document_index (int32), helpers.build_sample_idx (int32 below 2**31 entries, else
# int64; [samples + 1, 2]), _build_shuffle_index (uint32, int64 for 2**32 samples or more),
# BlendedDataset (int16 dataset ids, int64 sample ids).
_I2, _I4, _U4, _I8 = (numpy.dtype(t) for t in ("<i2", "<i4", "<u4", "<i8"))
INDEX_KINDS: Dict[str, Tuple[int, Tuple[numpy.dtype, ...]]] = {
    "document_index.npy": (1, (_I4,)),
    "sample_index.npy": (2, (_I4, _I8)),
    "shuffle_index.npy": (1, (_U4, _I8)),
    "dataset_index.npy": (1, (_I2,)),
    "dataset_sample_index.npy": (1, (_I8,)),
}


def _kind(path: str) -> str:
    name = os.path.basename(path)
    parts = name.split("-", 3)  # <md5 hex>-<class>-<split>-<kind>; only <kind> may hold "-"
    return parts[3] if len(parts) == 4 else name


def _refuse(path: str, why: str) -> ArgumentError:
    return ArgumentError(
        f"data cache file {path} {why}; refusing to read it (megatron's index caches are "
        f"plain integer arrays). Delete {os.path.dirname(path) or '.'} to have it rebuilt")


def check_index_file(path: str) -> Tuple[Tuple[int, ...], numpy.dtype]:
    """(shape, dtype) of a megatron index cache file, or ArgumentError naming it if it is
    not exactly an array of its kind. Reads the header only."""
    kind = _kind(path)
    if kind not in INDEX_KINDS:
        raise _refuse(path, f"is not one of megatron's index files ({', '.join(INDEX_KINDS)})")
    ndim, dtypes = INDEX_KINDS[kind]
    fmt = numpy.lib.format
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if fh.read(len(fmt.MAGIC_PREFIX)) != fmt.MAGIC_PREFIX:
                raise _refuse(path, "is not a .npy array (no \\x93NUMPY magic: a pickle or "
                                    "other data)")
            fh.seek(0)
            version = fmt.read_magic(fh)
            if version == (1, 0):
                shape, fortran, dtype = fmt.read_array_header_1_0(fh)
            elif version == (2, 0):
                shape, fortran, dtype = fmt.read_array_header_2_0(fh)
            else:
                raise _refuse(path, f"has .npy format version {version[0]}.{version[1]}, "
                                    f"which megatron does not write")
            data_start = fh.tell()
    except FileNotFoundError:
        raise
    except ArgumentError:
        raise
    except (OSError, ValueError, SyntaxError, TypeError) as err:
        raise _refuse(path, f"has an unreadable .npy header ({err})") from None
    if dtype not in dtypes:
        raise _refuse(path, f"holds dtype {dtype.str!r}; a {kind[:-4]} is "
                            f"{' or '.join(repr(d.str) for d in dtypes)}")
    if len(shape) != ndim or (ndim == 2 and shape[1] != 2):
        raise _refuse(path, f"has shape {shape}; a {kind[:-4]} is "
                            f"{'[n]' if ndim == 1 else '[n, 2]'}")
    if fortran:
        raise _refuse(path, "is in Fortran order; megatron writes C order")
    expected = data_start + int(numpy.prod(shape, dtype=numpy.int64)) * dtype.itemsize
    if size != expected:
        raise _refuse(path, f"is {size} bytes, but its header describes {expected} "
                            f"(truncated or padded)")
    return tuple(shape), dtype


def check_folder(folder: str) -> int:
    """check_index_file on every ``.npy`` in a cache folder; the number checked. Run on every
    rank before megatron's build, so a bad file stops all ranks together (megatron loads
    on rank 0 first and the others would wait for it at a barrier)."""
    if not folder or not os.path.isdir(folder):
        return 0
    names = sorted(n for n in os.listdir(folder) if n.endswith(".npy"))
    for name in names:
        check_index_file(os.path.join(folder, name))
    return len(names)


def load(file, mmap_mode=None, allow_pickle=False, **kwargs) -> Any:
    """numpy.load for megatron's dataset modules: a checked index file, never a pickle."""
    if isinstance(file, (str, os.PathLike)):
        path = os.fspath(file)
        check_index_file(path)
        try:
            return numpy.load(path, mmap_mode=mmap_mode, allow_pickle=False, **kwargs)
        except ValueError as err:  # replaced since the check: still never unpickled
            raise _refuse(path, f"cannot be read as an array ({err})") from None
    return numpy.load(file, mmap_mode=mmap_mode, allow_pickle=False, **kwargs)


def save(file, arr, allow_pickle=False, **kwargs) -> None:
    """numpy.save for megatron's dataset modules: no pickles, and atomic (temporary name,
    fsync, rename), so a killed build leaves whole files or none."""
    if not isinstance(file, (str, os.PathLike)):
        numpy.save(file, arr, allow_pickle=False, **kwargs)
        return
    from ..atomic_write import write_atomic

    path = os.fspath(file)
    if not path.endswith(".npy"):
        path += ".npy"  # numpy.save's own rule for a file name
    write_atomic(path, lambda fh: numpy.save(fh, arr, allow_pickle=False, **kwargs))


class _SafeNumpy(ModuleProxy):
    """``numpy`` as seen by a patched megatron dataset module."""

    MODULE = numpy
    load = staticmethod(load)
    save = staticmethod(save)


_ACTIVE = False


def check_version() -> str:
    return require_tested_version(
        "safe loading of megatron's dataset index caches",
        f"or set SWIFT_MCORE_ALLOW_UNTESTED_MCORE=1 after checking that "
        f"{', '.join(PATCHED_MODULES)} still read their caches with numpy.load")


def activate() -> None:
    """Install the safe numpy in megatron's GPT and blended dataset modules (idempotent).
    Call before any of those datasets is built; build_datasets and distributed.initialize do."""
    global _ACTIVE
    if _ACTIVE:
        return
    import importlib

    check_version()
    proxy = _SafeNumpy()
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "numpy", None) is not numpy and \
                not isinstance(getattr(module, "numpy", None), _SafeNumpy):
            raise RuntimeError(f"{name} has no module-level numpy to make safe; the installed "
                               f"megatron-core is not the one this adaptation was written for")
        module.numpy = proxy
    _ACTIVE = True

