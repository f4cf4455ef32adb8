"""rlhf rows (dpo/orpo/simpo pairs, kto rows, reward pairs) tokenized once, cached by their
task's data fingerprint.

Each task's encoded rows are a few token-id sequences per row (prompt, chosen, rejected, or
prompt, completion) plus per-row values (ORPO's prompt heads, KTO's label, a reward
margin). They are stored through array_cache.cached_arrays, the machinery sft's token
cache uses: every id sequence as one flat int32 array with int64 offsets, every per-row
value as its own array. The key is the task's fingerprint (preference_fingerprint,
unpaired_fingerprint, reward_fingerprint: content, tokenizer, chat template, flags), so a
changed input finds another folder; the folder is built by one process under the cache
lock while the others (every rank, later runs) wait and then map it read-only.
"""

from __future__ import annotations

import json
from typing import Callable, Dict, Sequence, Tuple

import numpy as np

# Part of the key: change it whenever the stored layout changes.
FORMAT = 1


class CachedRows:
    """The rows as the datasets index them: ``rows[i]`` is a tuple of the id sequences
    (memory-mapped slices) followed by the per-row values, in the order they were named."""

    def __init__(self, arrays, ragged: Sequence[str], values: Sequence[str]):
        self._ragged = [(arrays[name], arrays[name + "_offsets"]) for name in ragged]
        self._values = {name: arrays[name] for name in values}
        self._length = len(self._ragged[0][1]) - 1

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> tuple:
        if not -self._length <= index < self._length:
            raise IndexError(index)
        index %= self._length
        seqs = tuple(ids[int(offsets[index]):int(offsets[index + 1])]
                     for ids, offsets in self._ragged)
        return seqs + tuple(column[index] for column in self._values.values())

    def values(self, name: str) -> np.ndarray:
        """One per-row value of every row."""
        return self._values[name]


def _schema(ragged: Sequence[str], values: Dict[str, Tuple[str, int]]):
    schema = {}
    for name in ragged:
        schema[name] = ("int32", 1)
        schema[name + "_offsets"] = ("int64", 1)
    schema.update(values)
    return schema


def _build(encode: Callable[[], Tuple[list, dict]], ragged: Sequence[str],
           values: Dict[str, Tuple[str, int]]):
    def build(job) -> dict:
        rows, meta = encode()
        for k, name in enumerate(ragged):
            seqs = [row[k] for row in rows]
            offsets = np.zeros(len(seqs) + 1, np.int64)
            offsets[1:] = np.cumsum([len(s) for s in seqs])
            job.writer(name).append(np.concatenate(seqs) if seqs else np.zeros(0, np.int32))
            job.writer(name + "_offsets").append(offsets)
        for k, (name, (dtype, ndim)) in enumerate(values.items()):
            column = np.asarray([row[len(ragged) + k] for row in rows], dtype=dtype)
            job.writer(name).append(column.reshape((len(rows),) + column.shape[1:ndim]))
        return {"rows": len(rows), **meta}

    return build


def _check(ragged: Sequence[str], values: Dict[str, Tuple[str, int]], vocab_size: int):
    from .token_cache import check_token_ids

    def check(arrays, meta) -> None:
        # the encoding's report: counts and flags only
        for name, value in meta.items():
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"the manifest's {name} is not a count")
        rows = meta.get("rows")
        if rows is None:
            raise ValueError("the manifest does not count its rows")
        for name in ragged:
            ids, offsets = arrays[name], arrays[name + "_offsets"]
            if len(offsets) != rows + 1 or offsets[0] != 0 or offsets[-1] != len(ids) or \
                    (np.diff(offsets) < 0).any():
                raise ValueError(f"its {name} offsets are out of order")
            check_token_ids(ids, vocab_size)
        for name in values:
            if len(arrays[name]) != rows:
                raise ValueError(f"its {name} array does not hold one value per row")

    return check


def cached_rows(task: str, fingerprint: str, ragged: Sequence[str],
                values: Dict[str, Tuple[str, int]], encode: Callable[[], Tuple[list, dict]],
                vocab_size: int, on_event: Callable[[str], None] = lambda event: None
                ) -> Tuple[CachedRows, dict]:
    """(rows, meta) of ``task``'s data with this ``fingerprint``: from the cache, or made by
    ``encode() -> (rows, meta)`` once (a row is a tuple of the ``ragged`` id sequences, then
    the ``values``, name -> (dtype, ndim)); ``meta`` is JSON (the encoding's report).
    ``on_event`` hears "built" or "reused"."""
    from .array_cache import cached_arrays

    key = json.dumps({"what": "rlhf rows", "format": FORMAT, "task": task,
                      "fingerprint": fingerprint, "ragged": list(ragged),
                      "values": sorted(values)}, sort_keys=True)
    arrays, meta = cached_arrays("rlhf", key, _schema(ragged, values),
                                 _build(encode, ragged, values),
                                 check=_check(ragged, values, vocab_size), on_event=on_event)
    return CachedRows(arrays, ragged, list(values)), meta

