"""Stopping: SIGTERM saves and exits 0, and the run resumes exactly; SIGKILL at random
moments, including in the middle of a save, never leaves a checkpoint that resume would
pick up half-written, and the committed history trains every sample once.
(benchmarks/kill_resume.py runs the SIGKILL loop for many more trials.)"""

import os
import random
import signal

import pytest

import ckpt_harness as H
from swift_mcore.checkpointing import commit, folders

N = 12  # the three kills below end well before it (a save at every iteration)
GBS = H.TINY["global_batch_size"]


@pytest.fixture(scope="module")
def straight(straight_run):
    return straight_run(1, train_iters=N)  # test_async_save.py's too


def check_equal_to_straight(straight, out, world_size=1):
    a, b = H.trace(straight, 1), H.trace(out, world_size)
    assert sorted(b) == list(range(1, N + 1))
    for it in range(1, N + 1):
        assert b[it]["samples"] == a[it]["samples"]
        assert b[it]["loss"] == a[it]["loss"], (it, b[it]["loss"], a[it]["loss"])
    committed = H.committed_history(out)  # a replayed iteration's last record counts
    assert sorted(committed) == list(range(1, N + 1))
    ids = [i for it in sorted(committed) for i in committed[it]]
    assert ids == list(range(N * GBS)), "a sample trained twice, or one skipped"


@pytest.mark.slow
def test_sigterm_saves_exits_zero_and_resumes_exactly(tmp_path, flags, straight):
    out = str(tmp_path / "run")
    f = {**flags, "train_iters": N}
    seg = H.launch(out, f, 1)
    assert H.wait_for(lambda: len(H.records(out, "trace")) >= 3, seg)
    seg.signal(signal.SIGTERM)
    codes = seg.wait(120)
    seg.kill()
    assert codes == [0], seg.log_tail()
    log = seg.log_tail(100_000)
    assert "stop signal received" in log
    stopped = H.records(out, "done")[0]["state"]["iteration"]
    assert 3 <= stopped < N
    root = os.path.join(out, "checkpoint")
    assert folders.read_latest(root)[0] == stopped
    assert commit.check_complete(os.path.join(root, folders.iter_dir_name(stopped))) is None
    H.run(out, {**f, "resume": "auto"}, 1, tag="resume")
    assert H.records(out, "setup")[-1]["state"]["consumed_train_samples"] == stopped * GBS
    check_equal_to_straight(straight, out)


@pytest.mark.slow
def test_sigterm_to_one_of_two_ranks_stops_both(tmp_path, flags):
    out = str(tmp_path / "run")
    f = {**flags, "train_iters": N}
    seg = H.launch(out, f, 2)
    assert H.wait_for(lambda: len(H.records(out, "trace", 1)) >= 2, seg)
    seg.signal(signal.SIGTERM, ranks=[1])
    codes = seg.wait(120)
    seg.kill()
    assert codes == [0, 0], seg.log_tail()
    done = [H.records(out, "done", r)[0]["state"]["iteration"] for r in (0, 1)]
    assert done[0] == done[1] < N
    assert folders.read_latest(os.path.join(out, "checkpoint"))[0] == done[0]
    assert len(os.listdir(os.path.join(out, "checkpoint", folders.iter_dir_name(done[0]),
                                       "rng"))) == 2


@pytest.mark.slow
def test_sigkill_at_random_moments_and_mid_save(tmp_path, flags, straight):
    rnd = random.Random(1234)
    out = str(tmp_path / "run")
    f = {**flags, "train_iters": N, "save_steps": 1, "save_total_limit": 2, "resume": "auto"}
    trials = [H.kill_trial(out, f, mode, rnd) for mode in ("mid-save", "random", "mid-save")]
    for t in trials:
        assert t["started_at"] == t["newest_complete_before"], t
        assert t["consumed_at_start"] == t["started_at"] * GBS, t
    assert sum(t["mid_save"] for t in trials) >= 1, trials
    H.run(out, f, 1, tag="final")
    check_equal_to_straight(straight, out)
    root = os.path.join(out, "checkpoint")
    assert len(commit.complete_checkpoints(root)) == 2  # --save_total_limit 2
