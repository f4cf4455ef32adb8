"""Each rlhf task under tensor parallelism with --sequence_parallel gives the one-rank losses,
metrics and gradient norms: the log-probabilities summed from the vocabulary-parallel loss
(dpo, kto, orpo, simpo) and the reward model's head reading a sequence split over the
ranks (rm)."""

import json
import subprocess
import sys

import pytest

import hf_helpers as H
from in_process import train_in_process
from rlhf_helpers import run_flags
from run_helpers import ROOT, child_env

COMMON = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins")
LOGPS = ("logps/chosen", "logps/rejected")
# (metrics compared beyond COMMON, the trainer, flags)
TASKS = {
    "dpo": (LOGPS, "rlhf_trainer.DpoTrainer", ()),
    "kto": ((*LOGPS, "kl"), "kto_trainer.KtoTrainer", ("--undesirable_weight", "1.5")),
    "orpo": (LOGPS, "reference_free_trainer.ReferenceFreeTrainer", ()),
    "simpo": (LOGPS, "reference_free_trainer.ReferenceFreeTrainer", ()),
    "rm": (("min_reward", "max_reward"), "reward_trainer.RewardTrainer", ()),
    # rows of --seq_length 63 positions, padded to 64 (the split over two ranks)
    "dpo --packing": (LOGPS, "rlhf_trainer.DpoTrainer", ("--packing", "--seq_length", "63")),
    # four ranks: the policy's and the reference's activations pass between the stages split
    # along the sequence
    "dpo PP=2": (LOGPS, "rlhf_trainer.DpoTrainer", ()),
    # LoRA: the reference is the policy with its adapters off; the reward model's new score
    # head trains whole beside the adapters
    "dpo LoRA": (LOGPS, "rlhf_trainer.DpoTrainer", ("--tuner_type", "lora", "--lora_dropout",
                                                    "0")),
    "rm LoRA": (("min_reward", "max_reward"), "reward_trainer.RewardTrainer",
                ("--tuner_type", "lora", "--lora_dropout", "0")),
}


def curve(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r for r in rows if r.get("split") == "train"}


def trainer_class(path):
    import importlib

    module, name = path.split(".")
    return getattr(importlib.import_module(f"swift_mcore.training.{module}"), name)


def check_task(task, tiny_hf, kto_file, tmp_path):
    extra, trainer, task_flags = TASKS[task]
    folder, data = tiny_hf
    flags = ["--rlhf_type", task.split()[0], "--model", str(folder),
             "--dataset", str(kto_file if task == "kto" else data), "--train_iters", "3",
             "--no_save", *run_flags("--micro_batch_size", "2", *task_flags)]
    train_in_process(tmp_path / "one", *flags, command="rlhf", base=[],
                     trainer=trainer_class(trainer))
    pipeline = ["--pipeline_model_parallel_size", "2"] if "PP=2" in task else []
    env = child_env(NPROC_PER_NODE=str(4 if pipeline else 2), MASTER_PORT=str(H.free_port()))
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "rlhf", *flags, *pipeline,
                           "--tensor_model_parallel_size", "2", "--sequence_parallel",
                           "--output_dir", str(tmp_path / "sp")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, sp = curve(tmp_path / "one"), curve(tmp_path / "sp")
    assert sorted(one) == sorted(sp) == [1, 2, 3]
    for it in one:
        for name in (*COMMON, *extra):
            assert name in one[it], (it, name)
            assert sp[it][name] == pytest.approx(one[it][name], abs=1e-5), (it, name)
    assert one[3]["loss"] != one[1]["loss"]  # it trained


@pytest.mark.slow
@pytest.mark.parametrize("task", ["dpo", "rm"])
def test_sequence_parallel_gives_the_one_rank_run(task, tiny_hf, kto_file, tmp_path,
                                                   gloo_group):
    """One task per way the outputs reduce: the vocabulary-parallel loss, the score head."""
    check_task(task, tiny_hf, kto_file, tmp_path)


@pytest.mark.benchmark
@pytest.mark.parametrize("task", ["kto", "orpo", "simpo", "dpo --packing", "dpo PP=2",
                                  "dpo LoRA", "rm LoRA"])
def test_sequence_parallel_gives_the_one_rank_run_for_the_other_tasks(task, tiny_hf,
                                                                      kto_file, tmp_path,
                                                                      gloo_group):
    check_task(task, tiny_hf, kto_file, tmp_path)
