"""`swift-mcore preprocess sft` and `sft --cached_dataset`: conversations tokenized into a
folder once; training from it, without the raw files, gets the raw-file run's rows token for
token, at any --seq_length (packing re-planned from the stored sample lengths)."""

import json
import os
import shutil

import pytest

from swift_mcore import preprocess
from swift_mcore.arguments import SftArguments
from swift_mcore.data.sft_datasets import build_sft_datasets, sft_fingerprint
from swift_mcore.errors import ArgumentError
from swift_mcore.run_config import resolve


def conversation(i):
    return {"messages": [{"role": "user", "content": f"Question {i}: what is {i}+{i}?"},
                         {"role": "assistant", "content": f"It is {2 * i}." + " ok" * (i % 9)}]}


@pytest.fixture(scope="module")
def tok():
    from swift_mcore.data import default_tokenizer

    return default_tokenizer()


@pytest.fixture
def prepared(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFT_MCORE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(conversation(i)) + "\n" for i in range(30)),
                    encoding="utf-8")
    folder = str(tmp_path / "prepared")
    assert preprocess.main(["sft", "--dataset", str(path), "--template", "plain",
                            "--output_dir", folder]) == 0
    return str(path), folder


def sft_args(**flags):
    flags.setdefault("template", "plain")
    return resolve(SftArguments.from_flags(**flags), world_size=1, cuda=False)


def rows(dataset):
    return [[dataset[r][k].tolist() for k in ("tokens", "labels", "loss_mask", "position_ids",
                                              "segment_ids")] for r in range(len(dataset))]


def build(tok, **flags):
    logs = []
    train, valid, _ = build_sft_datasets(sft_args(**flags), tok, log=logs.append)
    return train, valid, logs


def test_cached_dataset_equals_the_raw_file_run_at_any_length(prepared, tok):
    path, folder = prepared
    raw = {}
    for seq, packing in ((64, False), (64, True), (40, True)):
        raw[seq, packing] = rows(build(tok, dataset=[path], seq_length=seq, packing=packing,
                                       truncation_strategy="right")[0])
    os.remove(path)  # the folder alone is enough
    for (seq, packing), want in raw.items():
        train, _, logs = build(tok, cached_dataset=folder, seq_length=seq, packing=packing,
                               truncation_strategy="right")
        assert rows(train) == want, (seq, packing)
    assert logs[0].startswith(f"sft data --cached_dataset {folder}: 30 of 30 conversations "
                              f"kept; ")
    # A held-out share works as with raw files.
    train, valid, _ = build(tok, cached_dataset=folder, seq_length=64, split_dataset_ratio=0.2)
    assert len(train) + len(valid) == 30 and len(valid) == 6


def test_the_fingerprint_is_the_raw_file_runs(prepared, tok):
    path, folder = prepared
    assert sft_fingerprint(sft_args(cached_dataset=folder, seq_length=64), tok) == \
        sft_fingerprint(sft_args(dataset=[path], seq_length=64), tok)


def test_other_flags_than_the_folders_are_refused(prepared, tok):
    _, folder = prepared
    with pytest.raises(ArgumentError, match=r"--cached_dataset .*prepared: was prepared with "
                                            r"--template \"plain\", this run has \"chatml\""):
        build(tok, cached_dataset=folder, template="chatml", seq_length=256)
    with pytest.raises(ArgumentError, match=r"was prepared with --system null, this run has "
                                            r"\"Be brief.\""):
        build(tok, cached_dataset=folder, seq_length=64, system="Be brief.")
    with pytest.raises(ArgumentError, match=r"--cached_dataset .*nowhere: not a folder "
                                            r"written by `swift-mcore preprocess sft` \(it has "
                                            r"no manifest.json\)"):
        build(tok, cached_dataset=folder + "-nowhere", seq_length=64)
    os.remove(os.path.join(folder, "ids.npy"))
    with pytest.raises(ArgumentError, match=r"--cached_dataset .*prepared: not a dataset "
                                            r"written by `swift-mcore preprocess sft` \(ids.npy: "
                                            r".*cannot be read"):
        build(tok, cached_dataset=folder, seq_length=64)
    with pytest.raises(ArgumentError, match=r"--dataset and --cached_dataset are alternatives"):
        sft_args(dataset=["x.jsonl"], cached_dataset=folder)


@pytest.mark.parametrize("check_bytes", [None, 256])
def test_answer_counts_and_conversation_counts_that_lie_are_refused(prepared, tok,
                                                                   monkeypatch, check_bytes):
    """A folder whose arrays or manifest were edited so that a sample's answer count is not
    its trained tokens (all targets cleared: it trained on nothing, loss 0), or whose
    conversation count exceeds its samples, is refused by name; a large cache's counts
    are checked in windows (check_bytes). A folder with no sample that fits --seq_length
    is named with the length."""
    import numpy as np

    from swift_mcore.data import token_cache

    if check_bytes:
        monkeypatch.setattr(token_cache, "ID_CHECK_BYTES", check_bytes)
    _, folder = prepared
    build(tok, cached_dataset=folder, seq_length=64)  # the folder as written
    targets = np.load(os.path.join(folder, "targets.npy"))
    np.save(os.path.join(folder, "targets.npy"), np.zeros_like(targets))
    with pytest.raises(ArgumentError, match=r"--cached_dataset .*prepared: not a dataset "
                                            r"written by `swift-mcore preprocess sft` \(sample "
                                            r"0's answer count \(\d+\) is not its trained "
                                            r"tokens \(0\)\)"):
        build(tok, cached_dataset=folder, seq_length=64)
    np.save(os.path.join(folder, "targets.npy"), targets)
    with pytest.raises(ArgumentError, match=r"^--cached_dataset .*prepared: no conversation is "
                                            r"left to train on at --seq_length 4; raise"):
        build(tok, cached_dataset=folder, seq_length=4)
    manifest = os.path.join(folder, "manifest.json")
    with open(manifest) as fh:
        values = json.load(fh)
    values["meta"]["conversations"] = 1000
    with open(manifest, "w") as fh:
        json.dump(values, fh)
    with pytest.raises(ArgumentError, match=r"the manifest's counts \(1000 conversations, 0 "
                                            r"split\) do not fit its 30 samples"):
        build(tok, cached_dataset=folder, seq_length=64)
    values["meta"]["conversations"] = True
    with open(manifest, "w") as fh:
        json.dump(values, fh)
    with pytest.raises(ArgumentError, match=r"the manifest's conversations is not a count"):
        build(tok, cached_dataset=folder, seq_length=64)


def test_preprocess_sft_refuses_an_existing_folder_and_needs_output_dir(prepared, capsys):
    path, folder = prepared
    before = sorted(os.listdir(folder))
    assert preprocess.main(["sft", "--dataset", path, "--output_dir", folder]) == 2
    assert f"--output_dir {folder}: exists; give a new folder" in capsys.readouterr().err
    assert sorted(os.listdir(folder)) == before
    assert preprocess.main(["sft", "--dataset", path]) == 2
    assert "--output_dir is required" in capsys.readouterr().err


@pytest.mark.slow
def test_training_from_the_folder_equals_training_from_the_files(prepared, tmp_path):
    from run_helpers import losses, run_sft

    path, folder = prepared
    flags = ["--template", "plain", "--train_iters", "3", "--packing", "true", "--seed", "3"]
    run_sft(tmp_path / "raw", "--dataset", path, *flags)
    os.remove(path)
    run_sft(tmp_path / "cached", "--cached_dataset", folder, *flags)
    assert losses(tmp_path / "cached") == losses(tmp_path / "raw")
    assert len(losses(tmp_path / "raw")) == 3


class _NoEncoding:
    """A tokenizer backend that refuses to encode (everything else passes through)."""

    def __init__(self, backend):
        self._backend = backend

    def __getattr__(self, name):
        if name.startswith("encode"):
            raise AssertionError(f"the tokenizer was called ({name})")
        return getattr(self._backend, name)


def test_a_stored_packing_plan_is_mapped_and_another_length_replans_without_encoding(
        tmp_path, monkeypatch, tok, capsys):
    """`preprocess sft --packing` stores the plan for its --seq_length in the folder;
    `sft --cached_dataset --packing` maps it at that length and re-plans from the stored
    tokens at another, never calling the tokenizer; both equal a fresh raw-file run's
    packed rows token for token."""
    monkeypatch.setenv("SWIFT_MCORE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(conversation(i)) + "\n" for i in range(40)),
                    encoding="utf-8")
    folder = str(tmp_path / "prepared")
    assert preprocess.main(["sft", "--dataset", str(path), "--template", "plain",
                            "--output_dir", folder, "--packing", "--seq_length", "64",
                            "--truncation_strategy", "right"]) == 0
    out = capsys.readouterr().out
    assert "packing plan stored for --seq_length 64 --truncation_strategy right: 40 samples " \
           "in " in out, out
    assert len(os.listdir(os.path.join(folder, "packing"))) == 1
    fresh = {seq: rows(build(tok, dataset=[str(path)], seq_length=seq, packing=True,
                             truncation_strategy="right")[0]) for seq in (64, 40)}
    os.remove(path)
    shutil.rmtree(tmp_path / "cache")  # no packing plan left in the cache: only the folder's
    tok.fingerprint  # noqa: B018  (computed before the backend is replaced)
    monkeypatch.setattr(tok, "backend", _NoEncoding(tok.backend))
    monkeypatch.setattr(tok, "encode", lambda *a: pytest.fail("the tokenizer was called"))
    monkeypatch.setattr(tok, "encode_batch", lambda *a: pytest.fail("the tokenizer was called"))
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps(conversation(3)) + "\n", encoding="utf-8")
    with pytest.raises(AssertionError, match="the tokenizer was called"):
        build(tok, dataset=[str(other)], seq_length=64)  # raw files do call it
    for seq, event in ((64, "packing stored"), (40, "packing built")):
        events = []
        train, _, _ = build_sft_datasets(
            sft_args(cached_dataset=folder, seq_length=seq, packing=True,
                     truncation_strategy="right"), tok, log=lambda line: None,
            on_cache=events.append)
        assert events == [event], (seq, events)
        assert rows(train) == fresh[seq], seq
    # A stored plan that is not a plain array (here a pickle's bytes) is never unpickled:
    # it fails its checks and the packing is planned again, to the same rows.
    plan = os.path.join(folder, "packing", os.listdir(os.path.join(folder, "packing"))[0])
    with open(os.path.join(plan, "members.npy"), "wb") as fh:
        fh.write(b"\x80\x04\x95" + b"\0" * 64)
    events = []
    train, _, _ = build_sft_datasets(
        sft_args(cached_dataset=folder, seq_length=64, packing=True,
                 truncation_strategy="right"), tok, log=lambda line: None,
        on_cache=events.append)
    assert events == ["packing built"] and rows(train) == fresh[64]


def test_preprocess_sft_packing_that_fits_nothing_leaves_no_folder(tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.setenv("SWIFT_MCORE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(conversation(i)) + "\n" for i in range(5)),
                    encoding="utf-8")
    folder = tmp_path / "prepared"
    assert preprocess.main(["sft", "--dataset", str(path), "--template", "plain",
                            "--output_dir", str(folder), "--packing", "--seq_length", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--packing: no conversation fits --seq_length 4" in err[0], err
    assert not folder.exists()
