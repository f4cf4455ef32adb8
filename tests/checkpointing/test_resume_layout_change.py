"""Resume on another parallel layout: data-parallel 2 -> 1 and 1 -> 2 (and tensor-parallel
2 -> 1, where dist_checkpointing reshards the weights). The global data position does not
depend on the number of ranks, so the resumed run consumes exactly the straight run's
samples; losses agree within 1e-5 (the reduction order differs).

Dropout is off here: with megatron's seeding every data-parallel rank draws the same
dropout stream, so with dropout on, a different DP size gives other masks to the same
samples by design (docs/resume.md)."""

import os

import pytest

import ckpt_harness as H

N, K = 12, 5
GBS = H.TINY["global_batch_size"]


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory, flags):
    """Straight runs at DP 1 and DP 2 that also save at iteration K."""
    base = tmp_path_factory.mktemp("layout")
    f = {**flags, "train_iters": N, "hidden_dropout": 0.0, "attention_dropout": 0.0,
         "save_steps": K}
    runs = {}
    for name, world, extra in (("dp1", 1, {}), ("dp2", 2, {})):
        out = str(base / name)
        H.run(out, {**f, **extra}, world)
        runs[name] = (out, world)
    return base, f, runs


def check_continuation(source, source_world, resumed, resumed_world):
    a, b = H.trace(source, source_world), H.trace(resumed, resumed_world)
    assert sorted(b) == list(range(K + 1, N + 1))
    head = [s for it in range(1, K + 1) for s in a[it]["samples"]]
    tail = [s for it in range(K + 1, N + 1) for s in b[it]["samples"]]
    straight = [s for it in range(1, N + 1) for s in a[it]["samples"]]
    assert sorted(head + tail) == sorted(straight)       # the multiset of consumed samples
    assert [sid for sid, _ in straight] == list(range(N * GBS))
    for it in range(K + 1, N + 1):
        assert b[it]["samples"] == a[it]["samples"]
        assert b[it]["consumed"] == it * GBS
        assert abs(b[it]["loss"] - a[it]["loss"]) < 1e-5, (it, b[it]["loss"], a[it]["loss"])
    setup = H.records(resumed, "setup")[0]["state"]
    assert setup["iteration"] == K and setup["consumed_train_samples"] == K * GBS


@pytest.mark.slow
@pytest.mark.parametrize("source,target_world", [("dp2", 1), ("dp1", 2)])
def test_resume_on_another_data_parallel_size(straight_runs, source, target_world):
    base, f, runs = straight_runs
    src, src_world = runs[source]
    out = str(base / f"{source}_to_dp{target_world}")
    H.run(out, {**f, "resume": os.path.join(src, "checkpoint", f"iter_{K:07d}")},
          target_world)
    check_continuation(src, src_world, out, target_world)
    log = open(os.path.join(out, f"log_seg_r{target_world - 1}.txt")).read()
    assert "parallel layout changed" in log


@pytest.mark.slow
def test_resume_tensor_parallel_2_to_1(straight_runs):
    base, f, runs = straight_runs
    tp2 = str(base / "tp2")
    H.run(tp2, {**f, "tensor_model_parallel_size": 2, "exit_interval": K}, 2)
    out = str(base / "tp2_to_tp1")
    H.run(out, {**f, "resume": os.path.join(tp2, "checkpoint", f"iter_{K:07d}")}, 1)
    dp1, _ = runs["dp1"]
    check_continuation(dp1, 1, out, 1)
    a, t = H.trace(dp1, 1), H.trace(tp2, 2)
    for it in range(1, K + 1):
        assert abs(t[it]["loss"] - a[it]["loss"]) < 1e-5
