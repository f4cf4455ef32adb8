"""Mixture-of-experts runs: the router losses reported next to the LM loss, and expert,
pipeline and tensor parallelism on gloo (EP=2, PP=2 and TP=2 give one rank's losses;
checkpoints reshard EP 1 -> 2, 2 -> 1 and PP 1 -> 2 and continue exactly)."""

import json

import pytest

from in_process import train_in_process
from run_helpers import losses, run_pt, train_records

MOE = ["--num_experts", "4", "--moe_router_topk", "2", "--moe_ffn_hidden_size", "32",
       "--moe_aux_loss_coeff", "0.01"]
# Strong router losses (test_tp2_sequence_parallel_gives_the_one_rank_moe_losses needs them).
ROUTER = [*MOE[:-1], "0.1", "--moe_z_loss_coeff", "0.01"]


@pytest.fixture(scope="module")
def ep1_run(tmp_path_factory, gloo_group):
    """EP=1 with ROUTER losses, four iterations, a checkpoint at iteration 2: the one-rank
    reference of the EP=2, PP=2 and TP=2 runs. The one-rank runs train in this process
    (tests/in_process.py); the resumed ones start from another process's checkpoint."""
    import torch
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    # What a bare MoE backward earlier in this process leaves behind (test_moe.py's, or a
    # user's own loop): megatron's process-wide aux-loss scale as a 0-dim tensor, which the
    # schedule's [1]-shaped scale cannot be copied into. The Trainer must start afresh.
    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0)
    # And megatron's layer-wise loss tracker as a one-layer model's forward left it, never
    # collected: its [1]-shaped values would raise an IndexError in this two-layer model, and
    # a loss left in it would be added to this run's first iteration.
    from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker

    save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(50.0), 1, 1)
    out = tmp_path_factory.mktemp("moe_ep1")
    proc = train_in_process(out, *ROUTER, "--train_iters", "4", "--save_steps", "2",
                            command="pt")
    return out, proc


def test_router_losses_are_logged_next_to_the_lm_loss(ep1_run, tmp_path, gloo_group):
    out, proc = ep1_run
    records = train_records(out)
    assert all(5 > r["load_balancing_loss"] > 0.9 and r["z_loss"] > 0 for r in records)
    assert "| load_balancing_loss " in proc.stdout and "| z_loss " in proc.stdout
    # The reported loss is the LM loss: the same run without router losses reports it too.
    plain = tmp_path / "plain"
    train_in_process(plain, *MOE[:-2], "--train_iters", "1", "--no_save", command="pt")
    assert abs(losses(plain)[1] - losses(out)[1]) < 1e-6
    assert "load_balancing_loss" not in train_records(plain)[0]


def test_ep2_resumes_ep1_checkpoint_with_its_losses(ep1_run, tmp_path):
    """EP 1 -> 2 (allgather dispatcher, dropless): iterations 3 and 4 as at EP=1."""
    out, _ = ep1_run
    ep2 = tmp_path / "ep2"
    run_pt(ep2, *ROUTER, "--train_iters", "4",
           "--expert_model_parallel_size", "2", "--moe_token_dispatcher_type", "allgather",
           "--resume", out / "checkpoint" / "iter_0000002", "--no_save", nproc=2)
    ref, got = losses(out), losses(ep2)
    assert sorted(got) == [3, 4]
    for it in (3, 4):
        assert abs(got[it] - ref[it]) < 1e-5, (it, got[it], ref[it])


def test_pp2_resumes_ep1_checkpoint_with_its_losses(ep1_run, tmp_path):
    """PP=2 (a MoE layer per stage): iterations 3 and 4 as at one rank, the router losses
    summed over the stages as one rank sums them over its layers."""
    out, _ = ep1_run
    pp2 = tmp_path / "pp2"
    run_pt(pp2, *ROUTER, "--train_iters", "4",
           "--pipeline_model_parallel_size", "2",
           "--resume", out / "checkpoint" / "iter_0000002", "--no_save", nproc=2)
    ref, got = {r["iteration"]: r for r in train_records(out)}, train_records(pp2)
    assert [r["iteration"] for r in got] == [3, 4]
    for g in got:
        for key in ("loss", "load_balancing_loss", "z_loss"):
            assert abs(g[key] - ref[g["iteration"]][key]) < 1e-5, (g["iteration"], key)


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory):
    """EP=2 (alltoall dispatcher, the plain optimizer), four iterations, a checkpoint at
    iteration 2: resumed at EP=1, and the reference of the distributed optimizer's run."""
    ep2 = tmp_path_factory.mktemp("moe_ep2")
    run_pt(ep2, *MOE, "--train_iters", "4", "--save_steps", "2",
           "--expert_model_parallel_size", "2", nproc=2)
    return ep2


def test_ep2_checkpoint_resumes_at_ep1_exactly(ep2_run, tmp_path, gloo_group):
    """EP 2 -> 1 (alltoall dispatcher): the EP=1 continuation equals EP=2's own."""
    ep2, ep1 = ep2_run, tmp_path / "ep1"
    train_in_process(ep1, *MOE, "--train_iters", "4", "--no_save",
                     "--resume", ep2 / "checkpoint" / "iter_0000002", command="pt")
    ref, got = losses(ep2), losses(ep1)
    assert sorted(got) == [3, 4]
    for it in (3, 4):
        assert abs(got[it] - ref[it]) < 1e-6, (it, got[it], ref[it])
    state = json.loads((ep2 / "checkpoint" / "iter_0000002" / "train_state.json").read_text())
    assert state["consumed_train_samples"] == 16


def test_tp2_sequence_parallel_gives_the_one_rank_moe_losses(ep1_run, tmp_path):
    """MoE with TP=2 needs --sequence_parallel (the router's and the norms' gradients are
    summed over the TP ranks); the alltoall dispatcher over TP x EP = 2 x 1, the experts
    TP-sharded. With strong router losses: megatron 0.16.1 weighs them 1/TP at TP > 1
    unless the coefficients are scaled (models/gpt.py:router_loss_scale; without it the
    LM loss is 1.7e-4 off at step 3), and the logged z-loss is one rank's slice unless
    averaged over TP (training/moe_metrics.py; 1.2e-2 off). Both the LM loss and the
    reported router losses are the one-rank ones (the one-rank run is ep1_run)."""
    one, _ = ep1_run
    tp2 = tmp_path / "tp2"
    run_pt(tp2, *ROUTER, "--train_iters", "4", "--no_save", "--tensor_model_parallel_size",
           "2", "--sequence_parallel", nproc=2, timeout=900)
    ref, got = train_records(one), train_records(tp2)
    assert [r["iteration"] for r in got] == [1, 2, 3, 4]
    for r, g in zip(ref, got):
        for key in ("loss", "load_balancing_loss", "z_loss"):
            assert abs(g[key] - r[key]) < 1e-5, (g["iteration"], key, g[key], r[key])


@pytest.mark.benchmark
def test_tp2_ep2_on_four_ranks_gives_the_one_rank_losses():
    """benchmarks/moe_tp_ep.py: TP=2 x EP=2 (both dispatchers) against one rank within 1e-5
    (LM and router losses), and its checkpoint resumed at one rank; four ranks per run,
    too slow for the suite (~5 min)."""
    import os
    import subprocess
    import sys

    from run_helpers import ROOT, child_env

    proc = subprocess.run([sys.executable, os.path.join("benchmarks", "moe_tp_ep.py"),
                           "--iters", "4"], capture_output=True, text=True, timeout=1800,
                          cwd=ROOT, env=child_env(PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and set(result["dispatchers"]) == {"alltoall", "allgather"}
    assert result["resumed_iterations"] == [4]


@pytest.mark.slow
def test_ep2_with_the_distributed_optimizer_gives_the_plain_losses_and_resumes_exactly(
        ep2_run, tmp_path):
    """EP=2 on 2 ranks with --use_distributed_optimizer (the dense state sharded over DP=2,
    the chained expert optimizer's over its expert-DP of 1): the plain optimizer's losses,
    a bit-exact resume from its own checkpoint, its continuation at EP=1 (one distributed
    optimizer over all parameters) and back at EP=2 with the same losses."""
    plain, dist, resumed = ep2_run, tmp_path / "dist", tmp_path / "resumed"
    ep2 = [*MOE, "--expert_model_parallel_size", "2", "--train_iters", "4"]
    run_pt(dist, *ep2, "--save_steps", "2", "--use_distributed_optimizer", nproc=2)
    ref, got = losses(plain), losses(dist)
    assert sorted(got) == [1, 2, 3, 4]
    for it in ref:
        assert abs(got[it] - ref[it]) <= 1e-6, (it, got[it], ref[it])
    checkpoint = dist / "checkpoint" / "iter_0000002"
    run_pt(resumed, *ep2, "--no_save", "--use_distributed_optimizer", "--resume", checkpoint,
           nproc=2)
    again = losses(resumed)
    assert sorted(again) == [3, 4] and all(again[it] == got[it] for it in again)
    run_pt(tmp_path / "ep1", *MOE, "--train_iters", "4", "--save_steps", "3",
           "--use_distributed_optimizer", "--resume", checkpoint, nproc=2)
    run_pt(tmp_path / "back", *ep2, "--no_save", "--use_distributed_optimizer", "--resume",
           tmp_path / "ep1" / "checkpoint" / "iter_0000003", nproc=2)
    ep1, back = losses(tmp_path / "ep1"), losses(tmp_path / "back")
    assert sorted(ep1) == [3, 4] and sorted(back) == [4]
    for it in ep1:  # iteration 4 only matches with Adam's moments and step restored
        assert abs(ep1[it] - got[it]) <= 1e-6, (it, ep1[it], got[it])
    assert abs(back[4] - got[4]) <= 1e-6, (back[4], got[4])
