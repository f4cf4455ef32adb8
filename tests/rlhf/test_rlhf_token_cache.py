"""The rlhf token cache: dpo/orpo/kto/rm rows tokenized once (the rows encoding them in
memory gives), reused by a later run without calling the tokenizer, rebuilt for a changed
file and for a tampered cache folder (which runs no code), and the same losses."""

import json
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from rlhf_helpers import KTO_ROWS, ROWS, run_flags


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("SWIFT_MCORE_CACHE", str(path))
    return path


def config_of(folder, data, out, *extra):
    """(config, tokenizer) of a one-rank rlhf run."""
    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.data.tokenizer import build_tokenizer
    from swift_mcore.run_config import resolve

    argv = ["--model", str(folder), "--dataset", str(data), "--output_dir", str(out),
            "--train_iters", "1", *run_flags(*extra)]
    config = resolve(parse_args(argv, prog="swift-mcore rlhf", cls=RlhfArguments),
                     world_size=1)
    return config, build_tokenizer(config)


def builder(task):
    from swift_mcore.data.preference import build_preference_datasets
    from swift_mcore.data.reward_pairs import build_reward_datasets
    from swift_mcore.data.unpaired import build_unpaired_datasets

    return {"dpo": build_preference_datasets, "orpo": build_preference_datasets,
            "kto": build_unpaired_datasets, "rm": build_reward_datasets}[task]


def uncached(task, config, tok):
    """What the in-memory path gives: the rows read and encoded here."""
    from swift_mcore.data import preference, reward_pairs, unpaired

    r = config.rlhf
    if task == "kto":
        rows = unpaired.read_unpaired(list(config.dataset_sources))
        return unpaired.encode_unpaired(rows, tok.hf, preference.max_length_of(config),
                                        r.truncation_mode, unpaired.UnpairedReport())
    pairs = preference.read_pairs(list(config.dataset_sources))
    if task == "rm":
        return reward_pairs.encode_reward_pairs(pairs, tok.hf,
                                                reward_pairs.max_length_of(config))[0]
    return preference.encode_pairs(pairs, tok.hf, preference.max_length_of(config),
                                   r.truncation_mode, preference.PairReport(),
                                   per_answer=task == "orpo")


def plain(rows):
    return [[np.asarray(v).tolist() for v in row] for row in rows]


def build(task, config, tok):
    events, logs = [], []
    train, _, _ = builder(task)(config, tok, log=logs.append, on_cache=events.append)
    return train, events, logs


class NoTokenizing:
    """The HF tokenizer with its tokenizing refused: a reused cache must not call it."""

    def __init__(self, hf):
        self._hf = hf

    def __call__(self, *args, **kwargs):
        raise AssertionError("the tokenizer was called")

    def apply_chat_template(self, *args, **kwargs):
        raise AssertionError("the chat template was applied")

    def __len__(self):
        return len(self._hf)

    def __getattr__(self, name):
        return getattr(self._hf, name)


TASKS = {"dpo": ("--rlhf_type", "dpo"), "orpo": ("--rlhf_type", "orpo"),
         "kto": ("--rlhf_type", "kto"), "rm": ("--rlhf_type", "rm")}


@pytest.mark.parametrize("task", sorted(TASKS))
def test_second_run_reuses_the_cache_without_tokenizing(task, tiny_hf, kto_file, cache,
                                                        tmp_path, monkeypatch):
    folder, prefs = tiny_hf
    data = kto_file if task == "kto" else prefs
    config, tok = config_of(folder, data, tmp_path / "out", *TASKS[task])
    first, events, logs = build(task, config, tok)
    assert events == ["built"]
    expected = plain(uncached(task, config, tok))
    assert plain(first.encoded[i] for i in range(len(first))) == expected
    assert len(first) == len(KTO_ROWS if task == "kto" else ROWS)

    monkeypatch.setattr(tok, "_hf", NoTokenizing(tok.hf))
    second, events, again = build(task, config, tok)
    assert events == ["reused"]
    assert again == logs  # the same report (counts, truncation, margins)
    assert plain(second.encoded[i] for i in range(len(second))) == expected
    batch = [second[i] for i in range(len(second))]
    for key, value in second.collate(batch).items():
        assert torch.equal(value, first.collate([first[i] for i in range(len(first))])[key])


def test_a_changed_file_is_not_served_stale(tiny_hf, cache, tmp_path):
    folder, _ = tiny_hf
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    config, tok = config_of(folder, data, tmp_path / "out")
    _, events, _ = build("dpo", config, tok)
    assert events == ["built"]
    changed = [dict(ROWS[0], chosen="\n    return b + a")] + ROWS[1:]
    data.write_text("".join(json.dumps(r) + "\n" for r in changed))
    config, tok = config_of(folder, data, tmp_path / "out")
    train, events, _ = build("dpo", config, tok)
    assert events == ["built"]
    assert plain(train.encoded[i] for i in range(len(train))) == \
        plain(uncached("dpo", config, tok))


class Payload:
    """Unpickling this would create the marker file: a cache must never unpickle."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def only_folder(cache):
    root = cache / "rlhf"
    [folder] = [p for p in root.iterdir() if not p.name.startswith(".")]
    return folder


@pytest.mark.parametrize("tamper", ["pickle", "vocabulary", "offsets", "meta"])
def test_a_tampered_cache_is_rebuilt_and_runs_no_code(tamper, tiny_hf, cache, tmp_path,
                                                      caplog):
    folder, data = tiny_hf
    config, tok = config_of(folder, data, tmp_path / "out")
    _, events, _ = build("dpo", config, tok)
    assert events == ["built"]
    stored = only_folder(cache)
    marker = tmp_path / "ran"
    if tamper == "pickle":  # an object array in place of the token ids
        with open(stored / "chosen.npy", "wb") as fh:
            np.save(fh, np.array([Payload(str(marker))], dtype=object), allow_pickle=True)
        assert b"open" in (stored / "chosen.npy").read_bytes()
    elif tamper == "vocabulary":  # ids of another vocabulary, same header
        ids = np.load(stored / "prompt.npy", mmap_mode="r+")
        ids[0] = tok.vocab_size + 5
        ids.flush()
        del ids
    elif tamper == "offsets":
        offsets = np.load(stored / "rejected_offsets.npy", mmap_mode="r+")
        offsets[1], offsets[2] = offsets[2], offsets[1]
        offsets.flush()
        del offsets
    else:
        manifest = json.loads((stored / "manifest.json").read_text())
        manifest["meta"]["truncated"] = "many"
        (stored / "manifest.json").write_text(json.dumps(manifest))
    train, events, _ = build("dpo", config, tok)
    assert events == ["built"]
    assert not marker.exists()
    assert plain(train.encoded[i] for i in range(len(train))) == \
        plain(uncached("dpo", config, tok))
    assert "rebuilding it" in caplog.text


def test_losses_with_the_cache_equal_those_without(tiny_hf, cache, tmp_path, gloo_group):
    """One DPO forward over the cached (memory-mapped) rows and over the rows encoded in
    memory: the same losses and metrics."""
    from swift_mcore.runtime import run_lock
    from swift_mcore.training.rlhf_trainer import DpoTrainer
    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.run_config import resolve

    folder, data = tiny_hf
    argv = ["--model", str(folder), "--dataset", str(data), "--output_dir",
            str(tmp_path / "out"), "--train_iters", "1", "--no_save", *run_flags()]
    trainer = DpoTrainer(resolve(parse_args(argv, prog="swift-mcore rlhf", cls=RlhfArguments),
                                 world_size=1))
    trainer.setup()
    try:
        ds = trainer.train_ds
        assert isinstance(ds.encoded[0][0], np.memmap)

        def loss():
            batch = ds.collate([ds[i] for i in range(len(ds))])
            losses = trainer.forward_backward(iter([batch]), forward_only=True)
            loss_sum, pairs, _ = trainer.reduce_losses(losses)
            return float(loss_sum / pairs), trainer.preference_metrics(losses)

        cached = loss()
        ds.encoded = uncached("dpo", trainer.config, trainer.tokenizer)
        assert not isinstance(ds.encoded[0][0], np.memmap)
        assert loss() == cached
    finally:
        trainer.writer.close()
        trainer.watchdog.close()
        run_lock.release(trainer.config.logging.output_dir)


def test_pickle_payload_is_real(tmp_path):
    """The tamper test's payload does run when unpickled (so its absence means something)."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(str(marker))))
    assert marker.exists()
    os.remove(marker)


SHARED = textwrap.dedent("""
    import json, sys
    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.data.preference import build_preference_datasets
    from swift_mcore.data.tokenizer import build_tokenizer
    from swift_mcore.run_config import resolve
    config = resolve(parse_args(json.loads(sys.argv[1]), prog="swift-mcore rlhf",
                                cls=RlhfArguments), world_size=1)
    events = []
    train, _, _ = build_preference_datasets(config, build_tokenizer(config),
                                            log=lambda s: None, on_cache=events.append)
    print(json.dumps({"events": events, "rows": [[v.tolist() for v in train.encoded[i]]
                                                  for i in range(len(train))]}))
""")


@pytest.mark.slow
def test_two_processes_share_one_build(tiny_hf, cache, tmp_path):
    """Two ranks starting at once: one tokenizes, the other waits and maps its arrays."""
    from run_helpers import ROOT, child_env

    folder, data = tiny_hf
    argv = ["--model", str(folder), "--dataset", str(data), "--output_dir",
            str(tmp_path / "out"), "--train_iters", "1", *run_flags()]
    env = child_env(SWIFT_MCORE_CACHE=str(cache), PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", SHARED, json.dumps(argv)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for _ in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(e for r in results for e in r["events"]) == ["built", "reused"]
    assert results[0]["rows"] == results[1]["rows"]
    assert len([p for p in (cache / "rlhf").iterdir() if not p.name.startswith(".")]) == 1
