"""Checkpoint-test fixtures: a tiny corpus whose epoch ends inside the runs, and flags."""

import pytest

import ckpt_harness as H


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """20 short documents: 33 training samples at seq 32, so with a global batch of 4 the
    first epoch ends inside iteration 9 (positions 32..35)."""
    return H.write_corpus(str(tmp_path_factory.mktemp("ckpt_corpus") / "corpus.jsonl"),
                          n_docs=20)


@pytest.fixture(scope="session")
def flags(corpus):
    return {**H.TINY, "dataset": [corpus], "split": "90,10,0"}



@pytest.fixture(scope="session")
def straight_cli(tmp_path_factory):
    """`swift-mcore pt` for 6 iterations, saved at 2, 4 and 6, never interrupted: what the
    interrupted runs of the lock and disk-full tests must equal."""
    from run_helpers import run_pt

    out = tmp_path_factory.mktemp("straight_cli") / "run"
    run_pt(out, *H.CLI_FLAGS)
    return out
