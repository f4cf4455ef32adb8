"""Exact resume with activation recompute on (full, dropout on): stopped at 2 and resumed to 4,
every loss is bit-for-bit the straight run's. The straight run is the one without recompute:
megatron's full recompute restores the RNG states it drew the dropout from, so the two are
the same run (tests/test_recompute.py: equal gradients), and one straight run checks both."""

import pytest

import ckpt_harness as H

N, K = 4, 2  # straight: the first N of the session's 12-iteration one-rank run


@pytest.mark.slow
def test_resume_with_recompute_is_bit_exact(tmp_path, flags, straight_run):
    # The straight run is test_resume_signals.py's and test_async_save.py's (run once per
    # session); the chained one trains the same 12-iteration schedule, stopped at K and N.
    straight = straight_run(1, train_iters=12)
    chained = str(tmp_path / "chained")
    recompute = {**flags, "train_iters": 12, "recompute_granularity": "full",
                 "recompute_method": "block", "recompute_num_layers": 1}
    H.run(chained, {**recompute, "exit_interval": K}, 1, tag="to2")
    H.run(chained, {**recompute, "exit_interval": N, "resume": "auto"}, 1, tag="final")
    a, b = H.trace(straight), H.trace(chained)
    assert sorted(b) == list(range(1, N + 1))
    assert H.records(chained, "setup")[-1]["state"]["iteration"] == K
    for it in range(1, N + 1):
        assert b[it]["samples"] == a[it]["samples"]
        assert b[it]["loss"] == a[it]["loss"], (
            f"iteration {it}: {b[it]['loss']!r} with recompute and resume, {a[it]['loss']!r} "
            f"straight without")
    assert "activation recompute full (block, 1 layer)" in open(
        tmp_path / "chained" / "log_final_r0.txt").read()
