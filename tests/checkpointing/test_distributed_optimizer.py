"""--use_distributed_optimizer on CPU (gloo): megatron's distributed optimizer trains as the
plain data-parallel optimizer does, its checkpoints resume bit-exactly at the same
data-parallel size and within float rounding at another (its state is saved whole per
parameter, megatron's fully reshardable layout), and a checkpoint whose optimizer state
is in the other optimizer's layout is refused, naming the flag.

Dropout is off: with megatron's seeding every data-parallel rank draws the same dropout
stream, so another DP size would give other masks to the same samples
(test_resume_layout_change.py)."""

import os

import pytest

import ckpt_harness as H
from swift_mcore.errors import CheckpointError

N, K = 8, 4
GBS = H.TINY["global_batch_size"]
DISTRIBUTED = {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
               "num_buckets": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, flags):
    """Straight runs that save at iteration K: plain DP=2, distributed DP=2 and DP=1."""
    base = tmp_path_factory.mktemp("distopt")
    f = {**flags, "train_iters": N, "hidden_dropout": 0.0, "attention_dropout": 0.0,
         "save_steps": K}
    out = {}
    for name, world, extra in (("plain2", 2, {}), ("dist2", 2, DISTRIBUTED),
                               ("dist1", 1, DISTRIBUTED)):
        out[name] = str(base / name)
        H.run(out[name], {**f, **extra}, world)
    return base, f, out


def checkpoint(folder):
    return os.path.join(folder, "checkpoint", f"iter_{K:07d}")


@pytest.mark.slow
def test_distributed_optimizer_gives_the_plain_data_parallel_losses(runs):
    _, _, out = runs
    plain, dist = H.trace(out["plain2"], 2), H.trace(out["dist2"], 2)
    assert sorted(dist) == list(range(1, N + 1))
    for it in plain:
        assert dist[it]["samples"] == plain[it]["samples"]
        assert abs(dist[it]["loss"] - plain[it]["loss"]) <= 1e-6, (it, dist[it], plain[it])
    # Its checkpoint holds the state per parameter (megatron's names), with the fp32 copy.
    from swift_mcore.checkpointing import files, io

    keys = io.tensor_shapes(checkpoint(out["dist2"]))
    for kind in ("exp_avg", "exp_avg_sq", "param"):
        assert keys[f"optimizer.state.{kind}.embedding.word_embeddings.weight"] == \
            keys["embedding.word_embeddings.weight"]
    contents = files.read_json(checkpoint(out["dist2"]), files.RUN)["contents"]
    assert contents["optimizer_format"] == "distributed/fully_reshardable"


def continues(source, source_world, resumed, resumed_world, exact):
    a, b = H.trace(source, source_world), H.trace(resumed, resumed_world)
    assert sorted(b) == list(range(K + 1, N + 1))
    for it in range(K + 1, N + 1):
        assert b[it]["samples"] == a[it]["samples"]
        assert b[it]["consumed"] == it * GBS
        if exact:
            assert b[it]["loss"] == a[it]["loss"], (it, b[it]["loss"], a[it]["loss"])
        else:
            assert abs(b[it]["loss"] - a[it]["loss"]) <= 1e-5, (it, b[it], a[it])


@pytest.mark.slow
@pytest.mark.parametrize("source,source_world,target_world", [
    ("dist2", 2, 2), ("dist2", 2, 1), ("dist1", 1, 2)])
def test_distributed_optimizer_resumes(runs, source, source_world, target_world):
    """At the same DP size bit for bit (the optimizer's moments, fp32 weights and step
    restored); at another within 1e-5, with the straight run's samples."""
    base, f, out = runs
    resumed = str(base / f"{source}_to_dp{target_world}")
    H.run(resumed, {**f, **DISTRIBUTED, "resume": checkpoint(out[source])}, target_world)
    continues(out[source], source_world, resumed, target_world,
              exact=source_world == target_world)


@pytest.mark.slow
@pytest.mark.parametrize("source,distributed,message", [
    ("plain2", True, "its optimizer state is in the 'plain' layout, and "
                     "--use_distributed_optimizer reads only 'distributed/fully_reshardable'"),
    ("dist2", False, "it was saved with --use_distributed_optimizer\\); resume with "
                     "--use_distributed_optimizer, or pass --no_load_optim"),
])
def test_a_checkpoint_of_the_other_optimizer_is_refused(runs, trainer_setup, source,
                                                        distributed, message):
    base, f, out = runs
    extra = DISTRIBUTED if distributed else {}
    target = str(base / f"refused_{source}")
    with pytest.raises(CheckpointError, match=message):
        trainer_setup(**{**f, **extra, "output_dir": target,
                         "resume": checkpoint(out[source])})
    assert not os.path.exists(os.path.join(target, "checkpoint"))
