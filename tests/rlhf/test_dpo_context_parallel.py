"""rlhf dpo under context parallelism: each sequence's log-probabilities summed over the CP
ranks' chunks give the one-rank losses, metrics and gradient norms (the other tasks, and
CP with pipeline stages: test_task_context_parallel.py; packed rows:
test_packing_context_parallel.py): packed rows pass the argument checks with CP, under
pipeline stages for dpo."""

import json
import subprocess
import sys

import pytest

import hf_helpers as H
from in_process import train_in_process
from rlhf_helpers import run_flags
from run_helpers import ROOT, child_env
from swift_mcore.arguments import RlhfArguments
from swift_mcore.errors import ArgumentError
from swift_mcore.run_config import resolve
from swift_mcore.training.rlhf_trainer import DpoTrainer

METRICS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins",
           "rewards/accuracies", "logps/chosen", "logps/rejected")


def curve(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r for r in rows if r.get("split") == "train"}


@pytest.mark.slow
def test_dpo_at_cp2_gives_the_one_rank_run(tiny_hf, tmp_path, gloo_group):
    """The frozen reference in the loop, the sft term on: every reduction over the pairs'
    log-probabilities (the sigmoid loss, the nll over the chosen tokens, the metrics)."""
    folder, data = tiny_hf
    flags = ["--rlhf_type", "dpo", "--model", str(folder), "--dataset", str(data),
             "--train_iters", "3", "--no_save", "--loss_type", "sigmoid", "sft",
             *run_flags("--micro_batch_size", "2")]
    train_in_process(tmp_path / "one", *flags, command="rlhf", base=[], trainer=DpoTrainer)
    env = child_env(NPROC_PER_NODE="2", MASTER_PORT=str(H.free_port()))
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "rlhf", *flags,
                           "--context_parallel_size", "2", "--output_dir", str(tmp_path / "cp")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CP 2" in proc.stdout
    one, cp = curve(tmp_path / "one"), curve(tmp_path / "cp")
    assert sorted(one) == sorted(cp) == [1, 2, 3]
    for it in one:
        for name in (*METRICS, "nll_loss"):
            assert name in one[it], (it, name)
            assert cp[it][name] == pytest.approx(one[it][name], abs=1e-5), (it, name)
    assert one[3]["loss"] != one[1]["loss"]  # it trained


SMALL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
             micro_batch_size=1, global_batch_size=2, context_parallel_size=2)


def test_rlhf_packing_with_cp_is_accepted_and_under_stages_for_dpo_only(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    args = RlhfArguments.from_flags(**SMALL, rlhf_type="orpo", packing=True,
                                    dataset=[str(data)])
    assert resolve(args, world_size=2, cuda=False).world.context_parallel == 2
    args = RlhfArguments.from_flags(**SMALL, rlhf_type="dpo", packing=True,
                                    pipeline_model_parallel_size=2, dataset=[str(data)])
    assert resolve(args, world_size=4, cuda=False).world.pipeline_parallel == 2
    args = RlhfArguments.from_flags(**SMALL, rlhf_type="orpo", packing=True,
                                    pipeline_model_parallel_size=2, dataset=[str(data)])
    with pytest.raises(ArgumentError, match="--packing with --pipeline_model_parallel_size 2 "
                                            "packs DPO's pairs only yet") as err:
        resolve(args, world_size=4, cuda=False)
    assert "\n" not in str(err.value)
