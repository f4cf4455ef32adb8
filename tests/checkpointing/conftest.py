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

