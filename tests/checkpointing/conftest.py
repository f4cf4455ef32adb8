"""Checkpoint-test fixtures: a tiny corpus whose epoch ends inside the runs, and flags."""

import json
import signal

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
def straight_run(tmp_path_factory, flags):
    """straight_run(world_size, **flags): the output folder of a segment with ``flags``
    (over the session's ``flags``) never interrupted, run once per session for each
    configuration: several tests hold their interrupted runs to the same straight run."""
    runs = {}

    def get(world_size, **extra):
        key = (world_size, json.dumps(extra, sort_keys=True))
        if key not in runs:
            out = str(tmp_path_factory.mktemp(f"straight{world_size}") / "run")
            H.run(out, {**flags, **extra}, world_size)
            runs[key] = out
        return runs[key]

    return get



@pytest.fixture(scope="session")
def straight_cli(tmp_path_factory):
    """`swift-mcore pt` for 6 iterations, saved at 2, 4 and 6, never interrupted: what the
    interrupted runs of the lock and disk-full tests must equal."""
    from run_helpers import run_pt

    out = tmp_path_factory.mktemp("straight_cli") / "run"
    run_pt(out, *H.CLI_FLAGS)
    return out


@pytest.fixture
def trainer_setup(gloo_group):
    """trainer_setup(**flags): a Trainer of these flags, set up in this process on the
    one-rank gloo group (fast, for resume attempts); afterwards its writer is closed and
    the signal handlers a successful setup installs are put back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    trainers = []

    def setup(**flags):
        from swift_mcore.arguments import RunArguments
        from swift_mcore.training.trainer import Trainer

        trainer = Trainer(RunArguments.from_flags(**flags))
        trainers.append(trainer)
        trainer.setup()
        return trainer

    yield setup
    for t in trainers:
        if getattr(t, "writer", None) is not None:
            t.writer.close()
    for s, handler in saved.items():
        signal.signal(s, handler)
