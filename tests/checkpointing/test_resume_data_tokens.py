"""--resume on a prefix whose .bin tokens were replaced (same lengths, byte-identical .idx) is
refused naming the data fingerprint: for a prefix made by `swift-mcore preprocess` (its
recorded sha256) and for one made elsewhere, without a record (the sampled blocks; the change
sits in the first one). The refused resume runs in this process (cli.main on a one-rank gloo
group, as test_planted_pickles.py's refusals)."""

import json
import os

import pytest

import ckpt_harness as H
from run_helpers import TINY, replace_tokens, run_pt

from swift_mcore.data import indexed


def make_prefix(folder):
    from swift_mcore.preprocess import parse, preprocess

    jsonl = H.write_corpus(str(folder / "corpus.jsonl"), n_docs=30, seed=5)
    prefix = str(folder / "corpus")
    preprocess(parse(["--input", jsonl, "--output_prefix", prefix, "--workers", "1",
                      "--progress_bar", "false"]))
    return prefix


def saved_fingerprint(out):
    with open(os.path.join(out, "checkpoint", "iter_0000002", "run.json")) as fh:
        return json.load(fh)["data_fingerprint"]


@pytest.mark.slow
@pytest.mark.parametrize("made_by", ["preprocess", "elsewhere"])
def test_resume_refuses_replaced_tokens(tmp_path, made_by, gloo_group, capsys):
    from swift_mcore.cli import main

    prefix = make_prefix(tmp_path)
    record = prefix + indexed.HASH_SUFFIX
    if made_by == "elsewhere" and os.path.exists(record):
        os.remove(record)  # as Megatron-LM's tool leaves it
    out = tmp_path / "run"
    flags = ["--data_path", prefix, "--split", "90,10,0", "--train_iters", 3]
    run_pt(out, *flags, "--exit_interval", 2)
    saved = saved_fingerprint(out)

    idx, size = open(prefix + ".idx", "rb").read(), os.path.getsize(prefix + ".bin")
    # preprocess: rewritten through the writer (a new sha256 recorded); elsewhere: edited in
    # place, inside the first sampled block, with no record
    replace_tokens(prefix, in_place=made_by != "preprocess")
    assert open(prefix + ".idx", "rb").read() == idx and os.path.getsize(prefix + ".bin") == size

    capsys.readouterr()
    code = main(["pt", *TINY, "--output_dir", str(out), *map(str, flags), "--resume", "auto"])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert "Traceback" not in err
    assert f"refusing to resume from {out}/checkpoint/iter_0000002" in err
    line = next(x for x in err.splitlines() if "training data" in x).strip()
    assert line.startswith(f"training data (content fingerprint): checkpoint {saved!r}, now "
                           f"'2:"), line
    assert not (out / "checkpoint" / "iter_0000003").exists()
    # What was compared: the recorded sha256's part, or only the sampled one.
    version, sampled, full, legacy = saved.split(":")
    assert version == "2" and (full == "-") == (made_by == "elsewhere")
