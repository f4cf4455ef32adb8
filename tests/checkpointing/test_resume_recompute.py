"""Exact resume with activation recompute on (full, dropout on): stopped at 2 and resumed,
every loss is bit-for-bit the straight run's. The straight run is the one without recompute:
megatron's full recompute restores the RNG states it drew the dropout from, so the two are
the same run (tests/test_recompute.py: equal gradients), and one straight run checks both."""

import pytest

import ckpt_harness as H

N = 4


@pytest.mark.slow
def test_resume_with_recompute_is_bit_exact(tmp_path, flags):
    f = {**flags, "train_iters": N, "save_steps": 2}
    straight, chained = str(tmp_path / "straight"), str(tmp_path / "chained")
    H.run(straight, f, 1)
    recompute = {**f, "recompute_granularity": "full", "recompute_method": "block",
                 "recompute_num_layers": 1}
    H.run(chained, {**recompute, "exit_interval": 2}, 1, tag="to2")
    H.run(chained, {**recompute, "resume": "auto"}, 1, tag="final")
    a, b = H.trace(straight), H.trace(chained)
    assert sorted(a) == sorted(b) == list(range(1, N + 1))
    for it in range(1, N + 1):
        assert b[it]["samples"] == a[it]["samples"]
        assert b[it]["loss"] == a[it]["loss"], (
            f"iteration {it}: {b[it]['loss']!r} with recompute and resume, {a[it]['loss']!r} "
            f"straight without")
    assert "activation recompute full (block, 1 layer)" in open(
        tmp_path / "chained" / "log_final_r0.txt").read()
