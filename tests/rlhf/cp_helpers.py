"""The rlhf context-parallel tests' runs: one rank in this process against CP=2 (or CP=2 x
PP=2) in processes, their training curves compared; CP ranks simulated in one process."""

import json
import subprocess
import sys

import pytest

import hf_helpers as H
from fake_group import GroupRank
from in_process import train_in_process
from run_helpers import ROOT, child_env

# rows of 32 positions, every pair or row of the data in one micro-batch of two
FLAGS = ("--train_iters", "3", "--no_save", "--attention_dropout", "0", "--hidden_dropout",
         "0")
DPO_METRICS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins",
               "rewards/accuracies", "logps/chosen", "logps/rejected", "nll_loss")


def curve(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r for r in rows if r.get("split") == "train"}


def run_cp2(out, *flags, stages: int = 1):
    """`swift-mcore rlhf` at --context_parallel_size 2 (x --pipeline_model_parallel_size
    ``stages``) on 2 x ``stages`` ranks."""
    pipeline = ("--pipeline_model_parallel_size", str(stages)) if stages > 1 else ()
    env = child_env(NPROC_PER_NODE=str(2 * stages), MASTER_PORT=str(H.free_port()))
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "rlhf", *flags,
                           "--context_parallel_size", "2", *pipeline, "--output_dir", str(out)],
                          capture_output=True, text=True, timeout=400 if stages == 1 else 900,
                          cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CP 2" in proc.stdout
    return proc


def one_rank_and_cp2(tmp_path, flags, trainer, stages: int = 1):
    """The curves of rlhf ``flags`` on one rank (in this process, ``trainer``) and at CP=2
    (``run_cp2``), and the CP run's process."""
    train_in_process(tmp_path / "one", *flags, command="rlhf", base=[], trainer=trainer)
    proc = run_cp2(tmp_path / "cp", *flags, stages=stages)
    return curve(tmp_path / "one"), curve(tmp_path / "cp"), proc


def assert_same_curves(one, cp, names):
    assert sorted(one) == sorted(cp) == [1, 2, 3]
    for it in one:
        for name in names:
            if one[it].get(name) is None:  # kto: a batch without one class has no metric
                assert cp[it].get(name) is None, (it, name)
                continue
            assert cp[it][name] == pytest.approx(one[it][name], abs=1e-5), (it, name)
    assert one[3]["loss"] != one[1]["loss"]  # it trained


def as_rank(monkeypatch, rank):
    """megatron's context-parallel state as rank ``rank`` of two sees it."""
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda: rank)
    monkeypatch.setattr(parallel_state, "get_context_parallel_group", lambda: GroupRank(rank))
