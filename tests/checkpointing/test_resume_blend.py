"""Exact resume on a weighted blend of two prefixes made by `swift-mcore preprocess`.

N iterations straight versus stop at k (past the blend's epoch boundary) + --resume: every
loss, learning rate, validation loss and global sample position (with a CRC of its tokens)
is identical, and each blended sample is fed exactly once.
"""

import pytest

import ckpt_harness as H

N = 10
GBS = H.TINY["global_batch_size"]


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    from swift_mcore.preprocess import parse, preprocess

    folder = tmp_path_factory.mktemp("blend")
    prefixes = []
    for name, n_docs, seed in (("a", 8, 11), ("b", 12, 12)):
        jsonl = H.write_corpus(str(folder / f"{name}.jsonl"), n_docs=n_docs, seed=seed)
        prefix = str(folder / name)
        preprocess(parse(["--input", jsonl, "--output_prefix", prefix, "--workers", "2",
                          "--progress_bar", "false"]))
        prefixes.append(prefix)
    return ["0.7", prefixes[0], "0.3", prefixes[1]]


@pytest.mark.slow
def test_resume_is_bit_exact_on_a_preprocessed_blend(tmp_path, blend):
    f = {**H.TINY, "data_path": blend, "split": "90,10,0", "train_iters": N, "eval_steps": 3,
         "eval_iters": 1}
    straight = str(tmp_path / "straight")
    H.run(straight, f, 1)
    train_len = H.records(straight, "setup")[0]["train_len"]
    k = train_len // GBS + 1  # the first iteration that reads from the blend's second epoch
    assert 2 <= k < N, f"the blend ({train_len} samples) no longer ends an epoch inside the run"

    chained = str(tmp_path / "chained")
    H.run(chained, {**f, "exit_interval": k}, 1, tag="first")
    H.run(chained, {**f, "resume": "auto"}, 1, tag="resumed")

    a, b = H.trace(straight), H.trace(chained)
    assert sorted(a) == sorted(b) == list(range(1, N + 1))
    for it in range(1, N + 1):
        assert b[it]["samples"] == a[it]["samples"], f"iteration {it}: other samples"
        assert (b[it]["loss"], b[it]["lr"]) == (a[it]["loss"], a[it]["lr"]), f"iteration {it}"
    evals = [(r["iteration"], r["val_loss"], r["consumed_valid"])
             for r in H.records(straight, "eval")]
    resumed_evals = {r["iteration"]: (r["iteration"], r["val_loss"], r["consumed_valid"])
                     for r in H.records(chained, "eval")}
    assert evals and [resumed_evals[it] for it, _, _ in evals] == evals

    setups = H.records(chained, "setup")
    assert [s["state"]["consumed_train_samples"] for s in setups] == [0, k * GBS]
    log = H.sample_log(chained)
    assert [r["iteration"] for r in log] == list(range(1, N + 1))
    assert [i for r in log for i in r["sample_ids"]] == list(range(N * GBS))
