"""The generic array cache (data/array_cache.py): a folder appears whole or not at all, a
second builder's folder never replaces the first, a failed build leaves nothing, and a link
planted at a cache folder's name is set aside, never followed."""

import os

import numpy as np
import pytest

from swift_mcore.data.array_cache import (CacheInvalid, build_folder, cache_folder,
                                          cached_arrays, load_arrays)

SCHEMA = {"values": ("int64", 1), "pairs": ("int32", 2)}


def builder(values, events=None):
    def build(job):
        if events is not None:
            events.append("build")
        job.writer("values").append(np.asarray(values[:2], np.int64))
        job.writer("values").append(np.asarray(values[2:], np.int64))
        job.writer("pairs").append(np.arange(6, dtype=np.int32).reshape(3, 2))
        return {"count": len(values)}
    return build


def test_arrays_are_written_in_chunks_and_mapped_back(fresh_cache):
    events = []
    arrays, meta = cached_arrays("test", "k", SCHEMA, builder([1, 2, 3, 4, 5]),
                                 on_event=events.append)
    assert arrays["values"].tolist() == [1, 2, 3, 4, 5] and meta == {"count": 5}
    assert arrays["pairs"].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert isinstance(arrays["values"], np.memmap) and not arrays["values"].flags.writeable
    assert cached_arrays("test", "k", SCHEMA, builder([9]), on_event=events.append)[1] == {
        "count": 5}
    assert events == ["built", "reused"]


def test_a_second_builders_rename_keeps_the_first_folder(fresh_cache, tmp_path):
    folder = str(tmp_path / "shared" / "entry")
    os.makedirs(os.path.dirname(folder))
    build_folder(folder, "k", SCHEMA, builder([1, 2, 3]))
    # Another node, which the lock did not reach, finishes the same build later.
    build_folder(folder, "k", SCHEMA, builder([7, 7, 7]))
    assert load_arrays(folder, "k", SCHEMA)[0]["values"].tolist() == [1, 2, 3]
    assert os.listdir(os.path.dirname(folder)) == ["entry"]  # no temporary folder left


def test_a_failed_build_leaves_nothing(fresh_cache):
    def failing(job):
        job.writer("values").append(np.arange(3))
        raise RuntimeError("tokenizer crashed")

    with pytest.raises(RuntimeError):
        cached_arrays("test", "k", SCHEMA, failing)
    folder = cache_folder("test", "k")
    assert not os.path.exists(folder)
    assert [n for n in os.listdir(os.path.dirname(folder)) if n != ".locks"] == []


def test_a_link_at_the_folders_name_is_set_aside_not_followed(fresh_cache, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    folder = cache_folder("test", "k")
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    os.symlink(victim, folder)
    with pytest.raises(CacheInvalid, match="not a folder"):
        load_arrays(folder, "k", SCHEMA)
    arrays, _ = cached_arrays("test", "k", SCHEMA, builder([1, 2, 3]))
    assert arrays["values"].tolist() == [1, 2, 3] and not os.path.islink(folder)
    assert os.listdir(victim) == ["keep.txt"] and (victim / "keep.txt").read_text() == "mine"
