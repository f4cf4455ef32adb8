"""ORPO runs end to end through the command: no reference is built, a stopped and resumed
run equals a straight one bit for bit (TRL's metrics included), and TP=2 gives the one-rank
losses and metrics."""

import subprocess
import sys

import pytest

from in_process import train_in_process
from rlhf_helpers import run_flags
from run_helpers import ROOT, child_env
from test_rlhf_resume import records

ORPO_METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
                "rewards/margins", "logps/chosen", "logps/rejected", "nll_loss",
                "log_odds_ratio", "log_odds_chosen", "grad_norm")


def argv(folder, data, *flags):
    return ["--model", str(folder), "--dataset", str(data), "--rlhf_type", "orpo",
            "--beta", "0.5", "--train_iters", "4",
            *run_flags("--micro_batch_size", "2", *map(str, flags))]


def trained(out):
    return {r["iteration"]: {k: r.get(k) for k in ORPO_METRICS} for r in records(out)
            if "loss" in r}


def rlhf(out, folder, data, *flags):
    """A real process: what a resume checked for exactness must start from."""
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "rlhf",
                           "--output_dir", str(out), *argv(folder, data, *flags)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_orpo_resume_is_bit_exact(tiny_hf, tmp_path, gloo_group):
    from swift_mcore.training.reference_free_trainer import ReferenceFreeTrainer

    folder, data = tiny_hf
    train_in_process(tmp_path / "whole", *argv(folder, data), command="rlhf", base=[],
                     trainer=ReferenceFreeTrainer)
    split = tmp_path / "split"
    # the first half may run here: the resume, checked for exactness, is a real process
    proc = train_in_process(split, *argv(folder, data, "--exit_interval", "2"),
                            command="rlhf", base=[], trainer=ReferenceFreeTrainer)
    assert "reference model: none (reference-free)" in proc.stdout
    assert "| log_odds_chosen " in proc.stdout and "| nll_loss " in proc.stdout
    assert sorted(trained(split)) == [1, 2]
    proc = rlhf(split, folder, data, "--resume")
    assert "starting at iteration 2" in proc.stdout
    whole = trained(tmp_path / "whole")
    assert sorted(whole) == [1, 2, 3, 4]
    assert all(v is not None for row in whole.values() for v in row.values())
    assert trained(split) == whole  # bit-equal, the metrics included
    assert whole[4]["rewards/margins"] > whole[1]["rewards/margins"]


@pytest.mark.benchmark
def test_orpo_under_tensor_parallelism_gives_the_one_rank_losses(tiny_hf, tmp_path,
                                                                  gloo_group):
    import hf_helpers as H
    from test_rlhf_parallel import curve

    from swift_mcore.training.reference_free_trainer import ReferenceFreeTrainer

    folder, data = tiny_hf
    flags = argv(folder, data, "--no_save")
    flags[flags.index("--train_iters") + 1] = "2"
    train_in_process(tmp_path / "one", *flags, command="rlhf", base=[],
                     trainer=ReferenceFreeTrainer)
    env = child_env(NPROC_PER_NODE="2", MASTER_PORT=str(H.free_port()))
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "rlhf", *flags,
                           "--tensor_model_parallel_size", "2", "--output_dir",
                           str(tmp_path / "tp2")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, tp2 = curve(tmp_path / "one"), curve(tmp_path / "tp2")
    assert sorted(one) == sorted(tp2) == [1, 2]
    for it in one:
        for name in ORPO_METRICS[:-1]:
            assert tp2[it][name] == pytest.approx(one[it][name], abs=1e-5), (it, name)
