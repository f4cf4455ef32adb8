"""A reward model under tensor parallelism gives the one-rank losses and metrics (each rank
holds the whole score head)."""

import json
import subprocess
import sys

import pytest

import hf_helpers as H
from in_process import train_in_process
from rlhf_helpers import run_flags
from run_helpers import ROOT, child_env

METRICS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins",
           "mean_reward", "min_reward", "max_reward")


def curve(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r for r in rows if r.get("split") == "train"}


@pytest.mark.benchmark
def test_tensor_parallel_gives_the_one_rank_losses(tiny_hf, tmp_path, gloo_group):
    from swift_mcore.training.reward_trainer import RewardTrainer

    folder, data = tiny_hf
    flags = ["--rlhf_type", "rm", "--model", str(folder), "--dataset", str(data),
             "--train_iters", "3", "--no_save", *run_flags("--micro_batch_size", "2")]
    train_in_process(tmp_path / "one", *flags, command="rlhf", base=[],
                     trainer=RewardTrainer)
    env = child_env(NPROC_PER_NODE="2", MASTER_PORT=str(H.free_port()))
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "rlhf", *flags,
                           "--tensor_model_parallel_size", "2", "--output_dir",
                           str(tmp_path / "tp2")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, tp2 = curve(tmp_path / "one"), curve(tmp_path / "tp2")
    assert sorted(one) == sorted(tp2) == [1, 2, 3]
    for it in one:
        for name in METRICS:
            assert tp2[it][name] == pytest.approx(one[it][name], abs=1e-5), (it, name)
    assert one[3]["rewards/margins"] > one[1]["rewards/margins"]  # it trained
