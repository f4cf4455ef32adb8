"""The interleaved pipeline (--num_virtual_stages_per_pipeline_rank, PP=2 x 2 virtual
stages on 2 gloo ranks), even and with an uneven first stage: from the same weights (a
one-rank checkpoint, resharded by dist_checkpointing into the four chunks) it gives the
one-rank losses, and its own checkpoints resume bit for bit (and at PP=1); and the flag
checks."""

import pytest

from run_helpers import check_layout_resumes_and_reshards, losses, run_pt
from swift_mcore.arguments import RunArguments
from swift_mcore.errors import ArgumentError
from swift_mcore.run_config import resolve

# 4 layers: one per chunk; 4 micro-batches per iteration, two groups of PP
SHAPE = ["--num_layers", "4", "--train_iters", "4"]
VPP = ["--pipeline_model_parallel_size", "2", "--num_virtual_stages_per_pipeline_rank", "2"]


@pytest.mark.slow
def test_interleaved_pipeline_gives_the_one_rank_losses_and_resumes_exactly(tmp_path):
    one, vpp, resumed = tmp_path / "one", tmp_path / "vpp", tmp_path / "resumed"
    run_pt(one, *SHAPE, "--save_steps", "1")
    run_pt(vpp, *SHAPE, *VPP, "--save_steps", "2",
           "--resume", one / "checkpoint" / "iter_0000001", nproc=2, timeout=600)
    ref, got = losses(one), losses(vpp)
    assert sorted(got) == [2, 3, 4]
    for it in got:
        assert abs(got[it] - ref[it]) <= 1e-5, (it, got[it], ref[it])
    run_pt(resumed, *SHAPE, *VPP, "--no_save",
           "--resume", vpp / "checkpoint" / "iter_0000002", nproc=2, timeout=600)
    again = losses(resumed)
    assert sorted(again) == [3, 4]
    assert all(again[it] == got[it] for it in again), (again, got)


@pytest.mark.benchmark
def test_uneven_interleaved_stages_give_the_one_rank_losses_resume_and_reshard(tmp_path):
    """PP=2 x 2 virtual stages with a 4-layer first stage of 6 layers (megatron's chunks:
    rank 0 layers 0-1 and 3-4, rank 1 layers 2 and 5): from a one-rank checkpoint it gives
    the one-rank losses, its own checkpoint resumes bit for bit, and that checkpoint
    continues at PP=1 with the straight run's losses."""
    uneven = [*VPP, "--decoder_first_pipeline_num_layers", "4"]
    stdout = check_layout_resumes_and_reshards(
        tmp_path, ["--num_layers", "6", "--train_iters", "4"], uneven, timeout=600)
    assert "PP 2" in stdout


SMALL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, micro_batch_size=1,
             global_batch_size=4)


@pytest.mark.parametrize("flags,world,message", [
    ({"num_virtual_stages_per_pipeline_rank": 2}, 1,
     "needs --pipeline_model_parallel_size > 1"),
    ({"pipeline_model_parallel_size": 2, "num_virtual_stages_per_pipeline_rank": 3}, 2,
     "--num_layers \\(4\\) must split into --pipeline_model_parallel_size \\(2\\) x virtual "
     "stages \\(3\\)"),
    ({"pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 2}, 2,
     "gives 1 virtual stage\\(s\\) per pipeline rank"),
    ({"pipeline_model_parallel_size": 2, "num_virtual_stages_per_pipeline_rank": 2,
      "num_layers_per_virtual_pipeline_stage": 1}, 2, "say the same; give one"),
    ({"pipeline_model_parallel_size": 2, "num_virtual_stages_per_pipeline_rank": 2,
      "global_batch_size": 3}, 2, "runs the micro-batches in groups of"),
])
def test_virtual_pipeline_flags_are_checked(flags, world, message):
    with pytest.raises(ArgumentError, match=message):
        resolve(RunArguments.from_flags(**{**SMALL, **flags}), world_size=world, cuda=False)
    ok = resolve(RunArguments.from_flags(**SMALL, pipeline_model_parallel_size=2,
                                         num_layers_per_virtual_pipeline_stage=1),
                 world_size=2, cuda=False)
    assert ok.args.virtual_stages() == 2
