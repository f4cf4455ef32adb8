"""Exact resume: N iterations straight versus stop at k + --resume, at world size 1 and 2.

Every iteration's loss (fp32, dropout on) is bit-for-bit equal, as are the learning rate,
the validation losses, the global sample positions and a CRC of every sample's tokens.
The stops include the iterations on both sides of the epoch boundary. Also the counter
regression: a resumed run starts at consumed_train_samples == iteration * GBS (non-zero),
and its first batch is the straight run's batch k+1.
"""

import os

import pytest

import ckpt_harness as H

N = 12
GBS = H.TINY["global_batch_size"]


def stops_for(train_len):
    boundary = train_len // GBS  # the last iteration that lies wholly in epoch 0
    return sorted({3, boundary, boundary + 1})


def run_chain(out, flags, world_size, stops):
    """Train to N in segments that stop at each k in ``stops`` (--exit_interval k)."""
    for i, k in enumerate(stops):
        extra = {"exit_interval": k}
        if i:
            extra["resume"] = "auto"
        H.run(out, {**flags, **extra}, world_size, tag=f"to{k}")
    H.run(out, {**flags, "resume": "auto"}, world_size, tag="final")


def check_exact(straight, chained, world_size, stops):
    a, b = H.trace(straight, world_size), H.trace(chained, world_size)
    assert sorted(a) == sorted(b) == list(range(1, N + 1))
    for it in range(1, N + 1):
        x, y = a[it], b[it]
        assert y["consumed"] == it * GBS
        assert y["samples"] == x["samples"], f"iteration {it}: other samples after resume"
        assert y["lr"] == x["lr"], f"iteration {it}: lr {y['lr']} != {x['lr']}"
        assert y["loss"] == x["loss"], (
            f"iteration {it}: loss {y['loss']!r} != straight {x['loss']!r} (stops {stops})")
    last = world_size - 1
    ea = [(r["iteration"], r["val_loss"], r["consumed_valid"])
          for r in H.records(straight, "eval", last)]
    eb = {r["iteration"]: (r["iteration"], r["val_loss"], r["consumed_valid"])
          for r in H.records(chained, "eval", last)}
    assert ea and [eb[it] for it, _, _ in ea] == ea

    # The counter regression: each resumed segment started at the checkpoint's counters.
    setups = H.records(chained, "setup", 0)
    assert [s["state"]["iteration"] for s in setups] == [0] + stops
    for setup, k in zip(setups[1:], stops):
        st = setup["state"]
        assert st["consumed_train_samples"] == k * GBS > 0
        assert st["consumed_valid_samples"] > 0 or k < 4
        first = b[k + 1]["samples"]
        assert [sid for sid, _ in first] == list(range(k * GBS, (k + 1) * GBS))
        assert first == a[k + 1]["samples"]

    # The trainer's audit log: every iteration once, positions contiguous, none repeated.
    log = H.sample_log(chained)
    assert [r["iteration"] for r in log] == list(range(1, N + 1))
    ids = [i for r in log for i in r["sample_ids"]]
    assert ids == list(range(N * GBS))


@pytest.mark.slow
def test_resume_is_bit_exact_one_rank(tmp_path, flags, straight_run):
    # Data loader workers, tensorboard and the progress bar on: none may touch the RNGs.
    one_rank = dict(train_iters=N, eval_steps=4, eval_iters=1, num_workers=1,
                    tensorboard=True, progress_bar=True)
    f = {**flags, **one_rank}
    straight = straight_run(1, **one_rank)
    train_len = H.records(straight, "setup")[0]["train_len"]
    assert N * GBS > train_len >= 4 * GBS, "the corpus no longer puts an epoch end in the run"
    stops = stops_for(train_len)
    chained = str(tmp_path / "chained")
    run_chain(chained, f, 1, stops)
    check_exact(straight, chained, 1, stops)
    assert "resumed from" in open(os.path.join(chained, "log_final_r0.txt")).read()


@pytest.mark.slow
def test_resume_is_bit_exact_two_ranks(tmp_path, flags, straight_run):
    assert H.TWO_RANK_RUN["train_iters"] == N
    f = {**flags, **H.TWO_RANK_RUN}
    straight = straight_run(2, **H.TWO_RANK_RUN)
    train_len = H.records(straight, "setup")[0]["train_len"]
    stops = stops_for(train_len)[1:]  # both sides of the epoch boundary
    chained = str(tmp_path / "chained")
    run_chain(chained, f, 2, stops)
    check_exact(straight, chained, 2, stops)
