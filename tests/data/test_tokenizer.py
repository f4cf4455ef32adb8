"""Tokenizers: the default BPE trains once, cached; HF folders and files load; bad input fails."""

import json
import subprocess
import sys
import time

import pytest

from run_helpers import ROOT
from swift_mcore.errors import ArgumentError
from swift_mcore.arguments import RunArguments
from swift_mcore.data import tokenizer as tok_mod
from swift_mcore.data.tokenizer import EOD_TOKEN, PAD_TOKEN, build_tokenizer, load_tokenizer

TEXTS = ["def add(a, b):\n    return a + b\n", "naïve café ✓ 日本語", "", "  two  spaces  "]


def test_default_trains_then_hits_the_cache(fresh_cache, monkeypatch):
    first = build_tokenizer(RunArguments())
    path = fresh_cache / "tokenizers"
    (folder,) = list(path.iterdir())
    assert (folder / "tokenizer.json").is_file()
    assert not [p for p in folder.iterdir() if ".tmp-" in p.name]

    def no_training(*args, **kwargs):
        raise AssertionError("the cached tokenizer should have been used")

    monkeypatch.setattr(tok_mod, "train_bpe", no_training)
    second = build_tokenizer(RunArguments())
    assert second.fingerprint == first.fingerprint
    for text in TEXTS:
        assert second.encode(text) == first.encode(text)


def test_default_vocabulary_and_specials(tokenizer):
    assert tokenizer.vocab_size == tok_mod.DEFAULT_VOCAB_SIZE == len(tokenizer.vocab)
    assert tokenizer.eod == tokenizer.vocab[EOD_TOKEN]
    assert tokenizer.pad == tokenizer.vocab[PAD_TOKEN] != tokenizer.eod
    assert tokenizer.eos == tokenizer.eod
    code = TEXTS[0]
    assert len(tokenizer.encode(code)) < len(code) / 2  # it learned something about Python
    assert tokenizer.encode_batch(TEXTS) == [tokenizer.encode(t) for t in TEXTS]
    for text in TEXTS:  # byte-level: every string survives the round trip
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode([tokenizer.eod]) == EOD_TOKEN
    json.dumps(tokenizer.unique_identifiers)  # megatron puts it into its cache descriptions


# A builder in its own interpreter: forking a pytest worker, whose torch, gloo and pyarrow
# threads may hold locks at the fork, once crashed the child in CI. Each builder says it is
# ready, starts when the test says go, and counts its trainings; the one that trains sleeps
# while it holds the lock, so the other is certainly waiting on it.
BUILDER = """
import os, sys, time
from swift_mcore.data import tokenizer as tok_mod
calls, ready, go = sys.argv[1:4]
real_train = tok_mod.train_bpe
def counting_train(*args, **kwargs):
    with open(calls, "a") as fh:
        fh.write("trained\\n")
    time.sleep(1.0)
    return real_train(*args, **kwargs)
tok_mod.train_bpe = counting_train
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.01)
print(tok_mod.default_tokenizer().fingerprint)
"""


def test_concurrent_builders_train_once_and_agree(fresh_cache, tmp_path):
    calls, go = tmp_path / "training_calls", tmp_path / "go"
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER, str(calls), str(r), str(go)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in ready]
    try:
        deadline = time.monotonic() + 120
        while not all(r.exists() for r in ready) and time.monotonic() < deadline:
            dead = [p for p in procs if p.poll() is not None]  # the other waits for go
            assert not dead, [p.communicate() for p in dead]
            time.sleep(0.02)
        go.touch()
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], results
    fingerprints = [out.strip() for out, _ in results]
    assert fingerprints[0] == fingerprints[1]
    assert calls.read_text() == "trained\n"  # the waiting process found the file, no retrain
    assert tok_mod.default_tokenizer().fingerprint == fingerprints[0]
    (folder,) = list((fresh_cache / "tokenizers").iterdir())
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "tokenizer.json"]


def test_saved_folder_and_file_load_back(tokenizer, tmp_path):
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    for path in (tmp_path / "tok", tmp_path / "tok" / "tokenizer.json"):
        loaded = load_tokenizer(str(path))
        assert loaded.vocab_size == tokenizer.vocab_size
        assert (loaded.eod, loaded.pad) == (tokenizer.eod, tokenizer.pad)
        assert [loaded.encode(t) for t in TEXTS] == [tokenizer.encode(t) for t in TEXTS]
        assert loaded.fingerprint == tokenizer.fingerprint
    args = RunArguments.from_flags(tokenizer=str(tmp_path / "tok"))
    assert build_tokenizer(args).source == str(tmp_path / "tok")


def test_hf_tokenizer_wrapper(tokenizer):
    hf = tokenizer.hf
    assert len(hf) == tokenizer.vocab_size
    assert hf.eos_token == EOD_TOKEN and hf.pad_token == PAD_TOKEN
    assert hf.encode(TEXTS[0], add_special_tokens=False) == tokenizer.encode(TEXTS[0])


def test_missing_path_names_the_flag(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ArgumentError, match=r"--tokenizer .*nope.* does not exist"):
        build_tokenizer(RunArguments.from_flags(tokenizer=missing))


def test_unloadable_path_names_the_flag(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ArgumentError, match=r"--tokenizer .*tokenizer.json could not be loaded"):
        build_tokenizer(RunArguments.from_flags(tokenizer=str(bad)))
    empty = tmp_path / "empty_folder"
    empty.mkdir()
    with pytest.raises(ArgumentError, match=r"--tokenizer .*empty_folder"):
        load_tokenizer(str(empty))


def test_tokenizer_without_eod_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    backend.save(str(path))
    with pytest.raises(ArgumentError, match=r"--tokenizer .*no end-of-document token"):
        load_tokenizer(str(path))


def test_other_special_token_names(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "</s>": 2, "[UNK]": 3},
                                         unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert (loaded.eod, loaded.pad) == (2, -1)  # -1: megatron's "no pad token"
    assert loaded.encode("a b a") == [0, 1, 0]
    assert loaded.hf.eos_token == "</s>" and loaded.hf.pad_token is None
    # A HF folder whose pad token is its EOS: pad must not alias the document separator.
    loaded.hf.pad_token = "</s>"
    loaded.save_pretrained(str(tmp_path / "folder"))
    folder = load_tokenizer(str(tmp_path / "folder"))
    assert folder.hf.pad_token_id == folder.eod == 2 and folder.pad == -1
