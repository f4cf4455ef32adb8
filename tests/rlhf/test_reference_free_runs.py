"""ORPO runs end to end through the command: no reference is built, and a stopped and
resumed run equals a straight one bit for bit (TRL's metrics included)."""

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
    proc = rlhf(split, folder, data, "--exit_interval", "2")
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
