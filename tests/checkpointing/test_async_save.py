"""--async_save: the shards are written in the background, the checkpoint is committed (sealed,
renamed, tracked) only once the write is done; resuming from it is exact, and a kill while
a background save runs resumes from the previous complete checkpoint, exactly."""

import os

import pytest

import ckpt_harness as H
from swift_mcore.checkpointing import commit, folders

N = 12
GBS = H.TINY["global_batch_size"]


@pytest.fixture(scope="module")
def straight1(straight_run):
    return straight_run(1, train_iters=N)  # test_resume_signals.py's too


def check_equal(straight, out):
    a, b = H.trace(straight, 1), H.trace(out, 1)
    assert sorted(b) == list(range(1, N + 1))
    for it in range(1, N + 1):
        assert b[it]["samples"] == a[it]["samples"], it
        assert b[it]["loss"] == a[it]["loss"], (it, b[it]["loss"], a[it]["loss"])
    committed = H.committed_history(out)
    assert [i for it in sorted(committed) for i in committed[it]] == list(range(N * GBS))


@pytest.mark.slow
def test_async_saves_commit_when_written_and_resume_exactly(tmp_path, flags, straight1):
    out = str(tmp_path / "run")
    f = {**flags, "train_iters": N, "save_steps": 2, "async_save": True}
    seg = H.run(out, {**f, "exit_interval": 4})
    root = os.path.join(out, "checkpoint")
    assert folders.read_latest(root)[0] == 4
    for it in (2, 4):
        assert commit.check_complete(os.path.join(root, folders.iter_dir_name(it))) is None
    log = seg.log_tail(100_000)
    assert "in the background" in log and "written in the background" in log
    assert not H.staging_folders(out)
    H.run(out, {**f, "resume": "auto"}, tag="resume")
    assert H.records(out, "setup")[-1]["state"]["iteration"] == 4
    check_equal(straight1, out)


@pytest.mark.slow
def test_a_kill_during_a_background_save_resumes_from_the_previous_one(tmp_path, flags,
                                                                        straight1):
    out = str(tmp_path / "run")
    f = {**flags, "train_iters": N, "save_steps": 2, "async_save": True, "resume": "auto"}
    # The run stops making progress in iteration 5, after iteration 4's background save has
    # started and before the loop could commit it (Trainer.finish_saves): the kill always
    # lands while that save is in flight, however fast its shards are written (racing the
    # writer against iteration 5 instead missed the window on a busy machine).
    seg = H.launch(out, f, extra={"stall": {"iteration": 5, "rank": 0}})
    root = os.path.join(out, "checkpoint")
    assert H.wait_for(lambda: len(H.records(out, "trace")) >= 4
                      and any("iter_0000004" in s for s in H.staging_folders(out)), seg)
    seg.kill()
    assert commit.complete_checkpoints(root)[-1][0] == 2
    assert folders.read_latest(root)[0] == 2
    newest = 2
    H.run(out, f, tag="resume")
    assert H.records(out, "setup")[-1]["state"]["iteration"] == newest
    check_equal(straight1, out)
