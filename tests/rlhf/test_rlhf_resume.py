"""rlhf stops and resumes bit-exactly (as sft does), and a resume against another reference
model is refused, naming --ref_model."""

import json
import subprocess
import sys

import pytest

import hf_helpers as H
from in_process import train_in_process
from rlhf_helpers import run_flags
from run_helpers import ROOT, child_env


def argv(folder, data, *flags):
    return ["--model", str(folder), "--dataset", str(data), "--train_iters", "4",
            "--rpo_alpha", "0.5",
            *run_flags("--micro_batch_size", "2", *map(str, flags))]


def rlhf(out, folder, data, *flags):
    """A real process: what a resume checked for exactness must start from."""
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "rlhf",
                           "--output_dir", str(out), *argv(folder, data, *flags)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def rlhf_here(out, folder, data, *flags):
    from swift_mcore.training.rlhf_trainer import DpoTrainer

    return train_in_process(out, *argv(folder, data, *flags), command="rlhf", base=[],
                            trainer=DpoTrainer)


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if '"train"' in line or "rewards/" in line]


def trained(out):
    """Per iteration: the loss and TRL's metrics, as written to metrics.jsonl."""
    keep = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
            "rewards/margins", "logps/chosen", "logps/rejected", "nll_loss", "grad_norm")
    rows = {}
    for r in records(out):
        if "loss" in r:
            rows[r["iteration"]] = {k: r[k] for k in keep}
    return rows


def test_resume_is_bit_exact_and_another_reference_is_refused(tiny_hf, tmp_path, gloo_group):
    from swift_mcore.errors import CheckpointError
    from swift_mcore.runtime import run_lock

    folder, data = tiny_hf
    rlhf_here(tmp_path / "whole", folder, data)
    split = tmp_path / "split"
    rlhf(split, folder, data, "--exit_interval", "2")
    assert sorted(trained(split)) == [1, 2]
    other = tmp_path / "other"
    H.make_model(str(other), "llama", seed=1, initializer_range=0.02)
    with pytest.raises(CheckpointError, match=r"reference model \(--ref_model, or the "
                                              r"starting weights of --model\): checkpoint "
                                              r"sha256:\w+, now sha256:\w+"):
        rlhf_here(split, folder, data, "--resume", "--ref_model", other)
    run_lock.release(str(split))  # as the command does when it ends (cli.run_training)
    # the loss's flags: another --beta or --loss_type resumed silently into another loss
    with pytest.raises(CheckpointError, match=r"(?s)--beta: checkpoint 0.1, now 0.5\n  "
                                              r"--rpo_alpha: checkpoint 0.5, now 0.25"):
        rlhf_here(split, folder, data, "--resume", "--beta", "0.5", "--rpo_alpha", "0.25")
    run_lock.release(str(split))
    assert sorted(trained(split)) == [1, 2]  # nothing trained, nothing lost
    proc = rlhf(split, folder, data, "--resume")
    assert "starting at iteration 2" in proc.stdout
    whole = trained(tmp_path / "whole")
    assert sorted(whole) == [1, 2, 3, 4]
    assert trained(split) == whole  # bit-equal, the metrics included
    assert whole[4]["rewards/margins"] > whole[1]["rewards/margins"]
