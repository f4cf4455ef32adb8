"""megatron's dataset index caches are never unpickled: a pickle planted in any of them (GPT
document/sample/shuffle index, blend dataset/dataset-sample index) is refused with one
line naming the file, on --resume and on a fresh run over a shared --data_cache_path, and
its payload never runs. Also: the checks on each file, atomic writes, and a scan for other
unpickling reads."""

import glob
import os
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from swift_mcore.data import safe_index_cache
from swift_mcore.errors import ArgumentError

from run_helpers import ROOT, run_pt

KINDS = ["document_index", "sample_index", "shuffle_index", "dataset_index",
         "dataset_sample_index"]


class Payload:
    """Unpickling this writes ``marker``: what a planted cache file would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def plant(path, marker):
    with open(path, "wb") as fh:
        pickle.dump(Payload(marker), fh)


def cache_file(folder, kind, split="train"):
    """The train-split file of ``kind`` (a GPTDataset one for the GPT kinds) in ``folder``."""
    cls = "BlendedDataset" if kind.startswith("dataset") else "GPTDataset"
    found = sorted(glob.glob(os.path.join(folder, "*", f"*-{cls}-{split}-{kind}.npy")))
    assert found, f"no {cls} {split} {kind} in {folder}"
    return found[0]


# ---- end to end: swift-mcore pt on a 2-prefix blend ---------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory, small_prefixes):
    """One run on a weighted 2-prefix blend: a checkpoint and every kind of cache file."""
    out = tmp_path_factory.mktemp("planted") / "run"
    blend = ["0.5", small_prefixes["a"], "0.5", small_prefixes["b"]]
    flags = ["--data_path", *blend, "--split", "90,10,0"]
    run_pt(out, *flags, "--train_iters", 2)
    return out, flags


def refused_run(out, flags, target, marker):
    proc = run_pt(out, *flags, check=False)
    assert not marker.exists(), "the planted pickle ran"
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("swift-mcore pt: error: data cache file ") and target in last, last
    assert "is not a .npy array" in last and "Delete " in last


@pytest.mark.slow
# Through the CLI: one GPT kind and one blend kind (every kind goes through the same
# checked load; test_planted_pickle_is_refused_by_a_build_over_a_shared_cache covers all five
# in process, at a fraction of the time).
@pytest.mark.parametrize("kind", ["shuffle_index", "dataset_sample_index"])
def test_planted_pickle_is_refused_on_resume(trained, tmp_path, kind):
    source, flags = trained
    out = tmp_path / "run"
    shutil.copytree(source, out)
    marker = tmp_path / "payload_ran"
    target = cache_file(str(out / "data_cache"), kind)
    plant(target, marker)
    refused_run(out, [*flags, "--resume", "auto", "--train_iters", 3], target, marker)
    assert not (out / "checkpoint" / "iter_0000003").exists()


@pytest.mark.slow
def test_planted_pickle_is_refused_on_a_fresh_run_over_a_shared_cache(trained, tmp_path):
    """One kind through the CLI; every kind in process below (the same code path)."""
    source, flags = trained
    shared = tmp_path / "shared_cache"
    shutil.copytree(source / "data_cache", shared)
    marker = tmp_path / "payload_ran"
    target = cache_file(str(shared), "dataset_sample_index")
    plant(target, marker)
    refused_run(tmp_path / "run", [*flags, "--data_cache_path", shared, "--train_iters", 2],
                target, marker)


# ---- in process: every kind on a fresh build over a shared cache, and the deep fix --------

@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory, small_prefixes, tokenizer, gloo_group):
    """A --data_cache_path filled by one build of a weighted 2-prefix blend."""
    from swift_mcore.data.gpt_datasets import build_datasets

    from data_helpers import make_args

    base = tmp_path_factory.mktemp("shared")
    blend = ["0.5", small_prefixes["a"], "0.5", small_prefixes["b"]]

    def args(out, cache):
        return make_args(base / out, data_path=blend, split="90,10,0",
                         data_cache_path=str(cache))

    build_datasets(args("first", base / "cache"), tokenizer)
    return base / "cache", args


@pytest.mark.parametrize("kind", KINDS)
def test_planted_pickle_is_refused_by_a_build_over_a_shared_cache(
        shared_cache, tokenizer, tmp_path, monkeypatch, kind):
    from megatron.core.datasets import blended_dataset, gpt_dataset

    from swift_mcore.data.gpt_datasets import build_datasets

    folder, make = shared_cache
    cache = tmp_path / "cache"
    shutil.copytree(folder, cache)
    marker = tmp_path / "payload_ran"
    target = cache_file(str(cache), kind)
    plant(target, marker)
    with pytest.raises(ArgumentError, match=re.escape(target) + " is not a .npy array"):
        build_datasets(make(tmp_path / "second", cache), tokenizer)
    # Without the folder check before the build, megatron's own numpy.load refuses it.
    for module in (gpt_dataset, blended_dataset):
        assert isinstance(module.numpy, safe_index_cache._SafeNumpy)
        assert module.numpy.random is np.random  # everything else is numpy itself
    monkeypatch.setattr(safe_index_cache, "check_folder", lambda folder: 0)
    with pytest.raises(ArgumentError, match=re.escape(target) + " is not a .npy array"):
        build_datasets(make(tmp_path / "third", cache), tokenizer)
    # The lazy loads (defer_npy_index_mmap) call the same numpy.load.
    with pytest.raises(ArgumentError, match="is not a .npy array"):
        gpt_dataset.numpy.load(target, allow_pickle=True, mmap_mode="r")
    assert not marker.exists()
    np.load(target, allow_pickle=True)  # the payload is live: megatron's own call runs it
    assert marker.exists()


# ---- the checks on one file ---------------------------------------------------------------

GOOD = {
    "document_index": np.arange(5, dtype=np.int32),
    "sample_index": np.zeros((4, 2), dtype=np.int32),
    "shuffle_index": np.arange(3, dtype=np.uint32),
    "dataset_index": np.zeros(6, dtype=np.int16),
    "dataset_sample_index": np.arange(6, dtype=np.int64),
}


def name(kind, cls="GPTDataset"):
    return f"0123456789abcdef0123456789abcdef-{cls}-train-{kind}.npy"


def test_each_kind_is_read_only_as_the_array_megatron_writes(tmp_path):
    marker = tmp_path / "payload_ran"
    for kind, array in GOOD.items():
        path = str(tmp_path / name(kind))
        safe_index_cache.save(path, array, allow_pickle=True)
        assert safe_index_cache.check_index_file(path) == (array.shape, array.dtype)
        np.testing.assert_array_equal(safe_index_cache.load(path, allow_pickle=True,
                                                            mmap_mode="r"), array)
    big = tmp_path / name("sample_index")
    safe_index_cache.save(str(big), np.zeros((3, 2), dtype=np.int64))  # int64 beyond 2**31
    assert safe_index_cache.check_index_file(str(big))[1] == np.int64

    whole = Path(big).read_bytes()
    bad = [  # (kind, what the message says, how the file is made)
        ("document_index", "is not a .npy array", lambda p: plant(p, marker)),
        ("document_index", "holds dtype '|O'", lambda p: np.save(
            p, np.array([Payload(marker)], dtype=object), allow_pickle=True)),
        ("document_index", "holds dtype '<f8'", lambda p: np.save(p, np.zeros(3))),
        ("document_index", "holds dtype '>i4'", lambda p: np.save(p, np.zeros(3, ">i4"))),
        ("document_index", "has shape (3, 2)", lambda p: np.save(p, np.zeros((3, 2), np.int32))),
        ("sample_index", "has shape (3,)", lambda p: np.save(p, np.zeros(3, np.int32))),
        ("sample_index", "has shape (3, 3)", lambda p: np.save(p, np.zeros((3, 3), np.int32))),
        ("sample_index", "is in Fortran order", lambda p: np.save(
            p, np.asfortranarray(np.zeros((3, 2), np.int32)))),
        ("sample_index", f"is {len(whole) - 8} bytes, but its header describes {len(whole)}",
         lambda p: Path(p).write_bytes(whole[:-8])),
        ("sample_index", f"is {len(whole) + 1} bytes, but its header describes {len(whole)}",
         lambda p: Path(p).write_bytes(whole + b"\0")),
        ("shuffle_index", "has an unreadable .npy header", lambda p: Path(p).write_bytes(
            b"\x93NUMPY\x01\x00\x20\x00{'descr': __import__('os')}   \n")),
        ("shuffle_index", "has .npy format version 9.0", lambda p: Path(p).write_bytes(
            b"\x93NUMPY\x09\x00" + whole[8:])),
    ]
    for number, (kind, why, make) in enumerate(bad):
        path = str(tmp_path / f"bad{number}" / name(kind))
        os.makedirs(os.path.dirname(path))
        make(path)
        for call in (safe_index_cache.check_index_file,
                     lambda p: safe_index_cache.load(p, allow_pickle=True, mmap_mode="r")):
            with pytest.raises(ArgumentError) as info:
                call(path)
            text = str(info.value)
            assert text.startswith(f"data cache file {path} ") and why in text, (why, text)
            assert "\n" not in text
    unknown = tmp_path / "other.npy"
    np.save(unknown, np.zeros(2, dtype=np.int32))
    with pytest.raises(ArgumentError, match="is not one of megatron's index files"):
        safe_index_cache.check_index_file(str(unknown))
    assert not marker.exists()


def test_save_is_atomic_and_check_folder_sees_every_file(tmp_path, monkeypatch):
    path = str(tmp_path / name("shuffle_index"))

    def dies(fh, arr, allow_pickle=False):
        fh.write(b"\x93NUMPY half")
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(np, "save", dies)
        with pytest.raises(KeyboardInterrupt):
            safe_index_cache.save(path, GOOD["shuffle_index"])
    assert os.listdir(tmp_path) == []  # neither a half file nor a temporary one
    for kind, array in GOOD.items():
        safe_index_cache.save(str(tmp_path / name(kind)), array)
    assert safe_index_cache.check_folder(str(tmp_path)) == len(GOOD)
    plant(tmp_path / name("dataset_index", "BlendedDataset"), tmp_path / "payload_ran")
    with pytest.raises(ArgumentError, match="BlendedDataset-train-dataset_index.npy is not"):
        safe_index_cache.check_folder(str(tmp_path))
    assert safe_index_cache.check_folder(str(tmp_path / "missing")) == 0


def test_activate_refuses_an_untested_megatron(monkeypatch):
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__version__", "0.99.0")
    with pytest.raises(RuntimeError, match="tested with megatron-core 0.16.1"):
        safe_index_cache.check_version()
    monkeypatch.setenv("SWIFT_MCORE_ALLOW_UNTESTED_MCORE", "1")
    assert safe_index_cache.check_version() == "0.99.0"


# ---- nothing else unpickles what it reads -------------------------------------------------

def unsafe_calls(source: str):
    """Calls that may unpickle what they read: any ``allow_pickle=True``, ``pickle.load(s)``,
    ``torch.load`` without ``weights_only=True``, ``np.load`` without ``allow_pickle=False``."""
    import ast

    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        keywords = {k.arg: getattr(k.value, "value", None) for k in node.keywords}
        func = ast.unparse(node.func)
        if keywords.get("allow_pickle") is True or func in ("pickle.load", "pickle.loads") \
                or func == "torch.load" and keywords.get("weights_only") is not True \
                or func in ("np.load", "numpy.load") and keywords.get("allow_pickle") is not False:
            yield node.lineno, ast.unparse(node)


def test_no_other_read_unpickles():
    """swift_mcore, its benchmarks and examples: no unpickling read outside safe_load.py's
    restricted unpickler; megatron's data modules that swift-mcore imports: every
    unpickling read sits in a module safe_index_cache patches."""
    ours = [p for folder in ("swift_mcore", "benchmarks", "examples")
            for p in (ROOT / folder).rglob("*.py")]
    hits = [f"{p.relative_to(ROOT)}:{line}: {call}" for p in ours
            for line, call in unsafe_calls(p.read_text())]
    assert hits == []
    import megatron.core.datasets as mcore_datasets

    folder = Path(mcore_datasets.__file__).parent
    used = ("gpt_dataset", "blended_dataset", "indexed_dataset", "megatron_dataset",
            "blended_megatron_dataset_builder", "blended_megatron_dataset_config", "utils",
            "helpers", "object_storage_utils")
    unsafe = {f"megatron.core.datasets.{n}" for n in used
              if list(unsafe_calls((folder / f"{n}.py").read_text()))}
    assert unsafe == set(safe_index_cache.PATCHED_MODULES)
    assert list(unsafe_calls("import numpy\nnumpy.load(p, allow_pickle=True)\n"))  # the scan sees
