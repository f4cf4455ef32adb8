"""Tokenized datasets as memory-mapped numpy arrays, built once per fingerprint and shared by
every rank and every later run.

``cached_arrays(kind, key, schema, build)`` returns ``(arrays, meta)``: the arrays named in
``schema`` memory-mapped read-only, and the JSON ``meta`` the builder returned. The folder is
named after ``key`` (a fingerprint of everything that decides the arrays), so a changed input
finds another folder and is never served from a stale one.

One process builds while the others wait on the cache lock (``cache.locked``). The build is
written into a temporary sibling folder and renamed into place whole: on a shared file system
where the lock does not reach other nodes, a reader still sees either no folder or a
complete one, and a second builder's rename fails and it uses the first one's folder.

Nothing read back runs code: the arrays are ``.npy`` files memory-mapped as plain numbers
(never ``np.load`` with pickles) after their headers are checked against the schema and ``manifest.json`` (dtype, shape, C
order), and ``check(arrays, meta)`` lets the caller check the values (offsets in order, token
ids in the vocabulary). A folder that fails any check is moved aside and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from ..atomic_write import temp_name
from ..cache import cache_dir, locked
from ..errors import ArgumentError
from ..input_files import open_regular

logger = logging.getLogger("swift_mcore")
MANIFEST = "manifest.json"
FORMAT = 1
# name -> (dtype, number of dimensions)
Schema = Dict[str, Tuple[str, int]]
Arrays = Dict[str, np.ndarray]


class CacheInvalid(Exception):
    """A cache folder that is incomplete, tampered with, or not what its name promises."""


class ArrayWriter:
    """Appends chunks of one array to a file; ``finish`` writes the ``.npy`` (header, then
    the data copied once), so a build never holds the whole array in memory."""

    def __init__(self, path: str, dtype: str, ndim: int = 1):
        self.path, self.dtype, self.ndim = path, np.dtype(dtype), ndim
        self.rows = 0
        self.inner: Optional[Tuple[int, ...]] = None
        self._raw = open(path + ".raw", "xb")

    def append(self, chunk: np.ndarray) -> None:
        chunk = np.ascontiguousarray(chunk, dtype=self.dtype)
        if chunk.ndim != self.ndim or (self.inner is not None and chunk.shape[1:] != self.inner):
            raise ValueError(f"{self.path}: chunk of shape {chunk.shape} does not fit")
        self.inner = chunk.shape[1:]
        self.rows += chunk.shape[0]
        self._raw.write(chunk.tobytes())

    def finish(self) -> Tuple[int, ...]:
        self._raw.close()
        shape = (self.rows, *(self.inner or (0,) * (self.ndim - 1)))
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                  "shape": shape}
        with open(self.path, "xb") as out, open(self.path + ".raw", "rb") as raw:
            np.lib.format.write_array_header_1_0(out, header)
            shutil.copyfileobj(raw, out, 16 << 20)
        os.remove(self.path + ".raw")
        return shape


class Build:
    """What a builder gets: ``writer(name)`` for each array of the schema, in a folder that
    becomes the cache only if the whole build succeeds."""

    def __init__(self, folder: str, schema: Schema):
        self.folder, self.schema = folder, schema
        self.writers: Dict[str, ArrayWriter] = {}

    def writer(self, name: str) -> ArrayWriter:
        if name not in self.writers:
            dtype, ndim = self.schema[name]
            self.writers[name] = ArrayWriter(os.path.join(self.folder, name + ".npy"), dtype,
                                             ndim)
        return self.writers[name]

    def finish(self) -> Dict[str, list]:
        missing = [n for n in self.schema if n not in self.writers]
        if missing:
            raise ValueError(f"the builder wrote no array {missing[0]!r}")
        return {name: list(w.finish()) for name, w in self.writers.items()}


def cache_folder(kind: str, key: str) -> str:
    """Where ``key``'s arrays live (not created): named by the key's sha256."""
    return os.path.join(cache_dir(kind), hashlib.sha256(key.encode()).hexdigest()[:24])


def cached_arrays(kind: str, key: str, schema: Schema, build: Callable[[Build], dict],
                  check: Optional[Callable[[Arrays, dict], None]] = None,
                  on_event: Callable[[str], None] = lambda event: None) -> Tuple[Arrays, dict]:
    """The arrays of ``key`` from the cache, built first by ``build(Build) -> meta`` if
    missing or invalid. ``on_event`` hears "built" or "reused" (what the tests count)."""
    folder = cache_folder(kind, key)
    try:
        found = load_arrays(folder, key, schema, check)
        on_event("reused")
        return found
    except CacheInvalid as err:
        if os.path.lexists(folder):
            logger.warning("warning: %s: %s; rebuilding it", folder, err)
    # The lock lives beside the folder: inside, it would keep the final rename from landing.
    with locked(os.path.join(os.path.dirname(folder), ".locks", os.path.basename(folder))):
        try:  # another process may have built it while this one waited
            found = load_arrays(folder, key, schema, check)
            on_event("reused")
            return found
        except CacheInvalid:
            _set_aside(folder)
        build_folder(folder, key, schema, build)
        on_event("built")
    return load_arrays(folder, key, schema, check)


def build_folder(folder: str, key: str, schema: Schema, build: Callable[[Build], dict]) -> None:
    """Writes ``key``'s arrays into a temporary sibling of ``folder``, then renames it into
    place (nothing is left behind by a failed build)."""
    tmp = temp_name(folder)
    os.makedirs(tmp)
    try:
        job = Build(tmp, schema)
        meta = build(job)
        shapes = job.finish()
        manifest = {"format": FORMAT, "key": key, "arrays": {
            n: {"dtype": np.dtype(schema[n][0]).str, "shape": shapes[n]} for n in schema},
            "meta": meta}
        with open(os.path.join(tmp, MANIFEST), "x", encoding="utf-8") as fh:
            json.dump(manifest, fh, indent=1)
        for name in os.listdir(tmp):
            with open(os.path.join(tmp, name), "rb") as fh:
                os.fsync(fh.fileno())
        try:
            os.rename(tmp, folder)
        except OSError:
            if not os.path.isdir(folder):
                raise
            # Another node renamed its build first (the lock did not reach it): keep that one.
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _set_aside(folder: str) -> None:
    """An invalid folder renamed away (readers that mapped it keep their files) and removed."""
    if not os.path.lexists(folder):
        return
    aside = temp_name(folder) + ".invalid"
    os.rename(folder, aside)
    if os.path.isdir(aside) and not os.path.islink(aside):
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.remove(aside)


def load_arrays(folder: str, key: Optional[str], schema: Schema,
                check: Optional[Callable[[Arrays, dict], None]] = None) -> Tuple[Arrays, dict]:
    """The arrays of a complete folder, memory-mapped read-only; ``key`` None accepts any
    key (a folder given by the user). Raises CacheInvalid saying what is wrong."""
    if os.path.islink(folder) or not os.path.isdir(folder):
        raise CacheInvalid("missing" if not os.path.lexists(folder) else "not a folder")
    try:
        with open_regular(os.path.join(folder, MANIFEST), "r", encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (OSError, ValueError, RecursionError, ArgumentError) as err:
        raise CacheInvalid(f"{MANIFEST} cannot be read ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CacheInvalid(f"{MANIFEST} is not of format {FORMAT}")
    if key is not None and manifest.get("key") != key:
        raise CacheInvalid(f"{MANIFEST} was written for other data")
    described = manifest.get("arrays")
    if not isinstance(described, dict):
        raise CacheInvalid(f"{MANIFEST} lists no arrays")
    arrays: Arrays = {}
    for name, (dtype, ndim) in schema.items():
        entry = described.get(name)
        if not isinstance(entry, dict) or entry.get("dtype") != np.dtype(dtype).str or \
                not isinstance(entry.get("shape"), list) or len(entry["shape"]) != ndim:
            raise CacheInvalid(f"{MANIFEST} does not describe array {name!r} as {dtype}")
        arrays[name] = _load_npy(os.path.join(folder, name + ".npy"), np.dtype(dtype),
                                 tuple(entry["shape"]))
    meta = manifest.get("meta")
    if not isinstance(meta, dict):
        raise CacheInvalid(f"{MANIFEST} has no meta object")
    if check is not None:
        try:
            check(arrays, meta)
        except (ValueError, KeyError, TypeError) as err:
            raise CacheInvalid(str(err)) from None
    return arrays, meta


def _load_npy(path: str, dtype: np.dtype, shape: Tuple[int, ...]) -> np.ndarray:
    """One .npy whose header must say exactly ``dtype``, ``shape``, C order, and whose size
    must match. An object array (the only kind that would unpickle) has no fixed dtype to
match, so it is refused before anything is mapped."""
    try:
        with open_regular(path, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            if version != (1, 0):
                raise CacheInvalid(f"{os.path.basename(path)} has npy version {version}")
            got_shape, fortran, got_dtype = np.lib.format.read_array_header_1_0(fh)
            data_start = fh.tell()
            size = os.fstat(fh.fileno()).st_size
    except CacheInvalid:
        raise
    except (OSError, ValueError, ArgumentError) as err:
        raise CacheInvalid(f"{os.path.basename(path)}: {err}") from None
    if got_dtype != dtype or tuple(got_shape) != shape or fortran:
        raise CacheInvalid(f"{os.path.basename(path)}: its header ({got_dtype}, "
                           f"{got_shape}) is not the manifest's ({dtype}, {shape})")
    if size != data_start + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise CacheInvalid(f"{os.path.basename(path)}: {size} bytes, not what its header says")
    if 0 in shape:
        return np.zeros(shape, dtype)
    # Mapped at the checked offset with the checked dtype: the header is not parsed again.
    return np.memmap(path, dtype=dtype, mode="r", offset=data_start, shape=shape)
