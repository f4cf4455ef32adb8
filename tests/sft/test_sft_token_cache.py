"""The sft token cache: conversations tokenized once (the same tokens as encoding them in
memory), reused by later runs and by concurrent processes, rebuilt for changed files,
tokenizers or templates, and for a cache folder that was tampered with."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from swift_mcore.arguments import SftArguments
from swift_mcore.data.conversations import read_conversations
from swift_mcore.data.sft_datasets import build_sft_datasets, encode_conversations
from swift_mcore.data.sources import expand_inputs
from swift_mcore.data.templates import Template
from swift_mcore.run_config import resolve

ROOT = Path(__file__).resolve().parents[2]


def conversation(i):
    return {"messages": [{"role": "user", "content": f"Question number {i}: what is {i}+{i}?"},
                         {"role": "assistant", "content": f"It is {2 * i}." + " ok" * (i % 7)}]}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("SWIFT_MCORE_CACHE", str(path))
    return path


@pytest.fixture(scope="module")
def tok():
    from swift_mcore.data import default_tokenizer

    return default_tokenizer()


def sft_args(**flags):
    flags.setdefault("seq_length", 48)
    flags.setdefault("template", "plain")
    return resolve(SftArguments.from_flags(**flags), world_size=1, cuda=False)


def build(args, tok):
    events, logs = [], []
    train, valid, _ = build_sft_datasets(args, tok, log=logs.append, on_cache=events.append)
    return train, valid, events, logs


def rows_of(dataset):
    return [[dataset[r][name].tolist() for name in ("tokens", "labels", "loss_mask")]
            for r in range(len(dataset))]


def uncached_rows(path, tok, template="plain", seq=48, truncation="drop"):
    """What the pre-cache path gives: rows read and encoded in memory."""
    convs = read_conversations(expand_inputs([path], "--dataset"), {})
    encoded = encode_conversations(convs, Template(template, tok), seq, truncation, "all_turns")
    return [(encoded.sample(k)[0].tolist(), encoded.sample(k)[1].tolist())
            for k in range(len(encoded))]


def samples_of(dataset):
    e = dataset.encoded
    return [(e.sample(k)[0].tolist(), e.sample(k)[1].tolist()) for k in range(len(e))]


def test_second_run_reuses_the_cache_with_the_same_tokens(cache, tmp_path, tok):
    path = write_jsonl(tmp_path / "a.jsonl", [conversation(i) for i in range(40)])
    first, _, events, logs = build(sft_args(dataset=[path], truncation_strategy="right"), tok)
    assert events == ["built"]
    assert samples_of(first) == uncached_rows(path, tok, truncation="right")
    again, _, events, logs_again = build(sft_args(dataset=[path], truncation_strategy="right"),
                                         tok)
    assert events == ["reused"]
    assert rows_of(again) == rows_of(first) and logs_again == logs
    # --seq_length, truncation and packing are applied to the cached samples: no rebuild.
    other, _, events, _ = build(sft_args(dataset=[path], seq_length=24,
                                         truncation_strategy="left"), tok)
    assert events == ["reused"]
    assert samples_of(other) == uncached_rows(path, tok, seq=24, truncation="left")
    # The packing plan is an index over the samples, cached by their lengths.
    packed, _, events, _ = build(sft_args(dataset=[path], packing=True), tok)
    assert events == ["reused", "packing built"]
    again, _, events, _ = build(sft_args(dataset=[path], packing=True), tok)
    assert events == ["reused", "packing reused"] and rows_of(again) == rows_of(packed)


def test_a_cached_packing_plan_equals_packing_afresh_and_a_bad_one_is_rebuilt(cache, tok):
    from swift_mcore.data.packing import pack
    from swift_mcore.data.token_cache import cached_pack_plan

    positions = np.random.default_rng(0).integers(1, 60, 500)
    fresh = pack(positions, 64)
    for event in ("built", "reused"):
        events = []
        members, offsets = cached_pack_plan(positions, 64, on_event=events.append)
        assert events == [event]
        assert [members[offsets[r]:offsets[r + 1]].tolist() for r in range(len(fresh))] == \
            fresh and len(offsets) == len(fresh) + 1
    # A plan that drops a sample, or whose rows overflow, is not used.
    [folder] = [p for p in (cache / "sft-packing").iterdir() if not p.name.startswith(".")]
    for tamper in ("duplicate", "overflow"):
        members = np.load(folder / "members.npy")
        offsets = np.load(folder / "row_offsets.npy")
        if tamper == "duplicate":
            members[0] = members[1]
        else:  # a row takes the next row's first sample, and overflows
            r = next(r for r in range(len(offsets) - 2)
                     if offsets[r + 2] - offsets[r + 1] > 1
                     and positions[members[offsets[r]:offsets[r + 1] + 1]].sum() > 64)
            offsets[r + 1] += 1
        np.save(folder / "members.npy", members)
        np.save(folder / "row_offsets.npy", offsets)
        events = []
        members, offsets = cached_pack_plan(positions, 64, on_event=events.append)
        assert events == ["built"], tamper
        assert [members[offsets[r]:offsets[r + 1]].tolist() for r in range(len(fresh))] == fresh


def test_changed_file_template_or_tokenizer_builds_anew(cache, tmp_path, tok):
    from chat_templates import QWEN_SPECIAL, chat_tokenizer

    path = write_jsonl(tmp_path / "a.jsonl", [conversation(i) for i in range(6)])
    assert build(sft_args(dataset=[path]), tok)[2] == ["built"]
    write_jsonl(tmp_path / "a.jsonl", [conversation(i) for i in range(1, 7)])
    changed, _, events, _ = build(sft_args(dataset=[path]), tok)
    assert events == ["built"]
    assert samples_of(changed) == uncached_rows(path, tok)
    chatml, _, events, _ = build(sft_args(dataset=[path], template="chatml", seq_length=256),
                                 tok)
    assert events == ["built"]
    assert samples_of(chatml) == uncached_rows(path, tok, template="chatml", seq=256)
    assert build(sft_args(dataset=[path], system="Be brief."), tok)[2] == ["built"]
    other_tok = chat_tokenizer("with-chatml-tokens", "{{ 'x' }}", QWEN_SPECIAL)
    assert other_tok.fingerprint != tok.fingerprint
    assert build(sft_args(dataset=[path]), other_tok)[2] == ["built"]
    # Each of them is now cached.
    assert build(sft_args(dataset=[path], template="chatml", seq_length=256), tok)[2] == [
        "reused"]


def test_worker_processes_give_the_same_tokens(cache, tmp_path, tok):
    # More conversations than one worker chunk, so two workers each encode some.
    path = write_jsonl(tmp_path / "a.jsonl", [conversation(i) for i in range(600)])
    two, _, events, _ = build(sft_args(dataset=[path], dataset_num_proc=2), tok)
    assert events == ["built"]
    assert samples_of(two) == uncached_rows(path, tok)


SHARED = textwrap.dedent("""
    import json, sys
    from swift_mcore.arguments import SftArguments
    from swift_mcore.data import default_tokenizer
    from swift_mcore.data.sft_datasets import build_sft_datasets
    from swift_mcore.run_config import resolve
    args = resolve(SftArguments.from_flags(dataset=[sys.argv[1]], seq_length=48,
                                           template="plain"), world_size=1, cuda=False)
    events = []
    train, _, _ = build_sft_datasets(args, default_tokenizer(), log=lambda s: None,
                                     on_cache=events.append)
    print(json.dumps({"events": events, "tokens": [train[r]["tokens"].tolist()
                                                    for r in range(len(train))]}))
""")


@pytest.mark.slow
def test_two_processes_share_one_build(cache, tmp_path, tok):
    path = write_jsonl(tmp_path / "a.jsonl", [conversation(i) for i in range(300)])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", SHARED, path], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(e for r in results for e in r["events"]) == ["built", "reused"]
    assert results[0]["tokens"] == results[1]["tokens"]
    assert len(os.listdir(cache / "sft")) == 2  # one folder, and the folder of its lock


def test_tampered_cache_runs_no_code_and_is_rebuilt(cache, tmp_path, tok):
    path = write_jsonl(tmp_path / "a.jsonl", [conversation(i) for i in range(8)])
    first = rows_of(build(sft_args(dataset=[path]), tok)[0])  # read before the files change
    [folder] = [p for p in (cache / "sft").iterdir() if not p.name.startswith(".")]
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    # ids.npy replaced by an object array whose unpickling would create the marker file.
    ids_path = folder / "ids.npy"
    os.chmod(ids_path, 0o644)
    np.save(ids_path, np.array([Payload()], dtype=object), allow_pickle=True)
    assert not marker.exists()
    rebuilt, _, events, _ = build(sft_args(dataset=[path]), tok)
    assert events == ["built"] and not marker.exists()
    assert rows_of(rebuilt) == first
    # Token ids outside the vocabulary with a matching header and manifest: rebuilt too.
    ids = np.load(ids_path)
    ids[0] = tok.vocab_size + 5
    np.save(ids_path, ids)
    again, _, events, _ = build(sft_args(dataset=[path]), tok)
    assert events == ["built"] and rows_of(again) == first
    # Offsets out of order.
    offsets = np.load(folder / "offsets.npy")
    offsets[1], offsets[2] = offsets[2], offsets[1]
    np.save(folder / "offsets.npy", offsets)
    assert build(sft_args(dataset=[path]), tok)[2] == ["built"]
    # A manifest that promises another dtype.
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["arrays"]["ids"]["dtype"] = "<i8"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert build(sft_args(dataset=[path]), tok)[2] == ["built"]
    assert build(sft_args(dataset=[path]), tok)[2] == ["reused"]


def test_a_row_refused_in_a_worker_is_named_and_nothing_is_cached(cache, tmp_path, tok):
    from swift_mcore.errors import ArgumentError

    rows = [conversation(i) for i in range(300)]
    rows[290]["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    with pytest.raises(ArgumentError, match=r"--dataset .*a.jsonl, row 290: the conversation "
                                            r"has a 'tools' list, which the built-in template "
                                            r"'plain' does not render"):
        build(sft_args(dataset=[path], dataset_num_proc=2), tok)
    assert [p.name for p in (cache / "sft").iterdir() if not p.name.startswith(".")] == []
