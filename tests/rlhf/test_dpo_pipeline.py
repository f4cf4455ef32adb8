"""DPO under pipeline parallelism (PP=2: the policy's and the reference's activations passed
between the stages side by side) gives the one-rank losses and metrics, packed rows too;
what does not run under it yet is refused in one line (the other tasks:
test_rlhf_pipeline.py)."""

import json
import subprocess
import sys

import pytest

import hf_helpers as H
from in_process import train_in_process
from rlhf_helpers import run_flags
from run_helpers import ROOT, child_env

METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
           "rewards/margins", "logps/chosen", "logps/rejected", "nll_loss")


def curve(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r for r in rows if r.get("split") == "train"}


@pytest.mark.benchmark
@pytest.mark.parametrize("reference", [[], ["--tuner_type", "lora"], ["--reference_free"]],
                         ids=["copy", "lora", "reference_free"])
def test_pipeline_parallel_gives_the_one_rank_losses(reference, tiny_hf, tmp_path,
                                                     gloo_group):
    from swift_mcore.training.rlhf_trainer import DpoTrainer

    folder, data = tiny_hf
    flags = ["--model", str(folder), "--dataset", str(data), "--train_iters", "3",
             "--no_save", "--rpo_alpha", "0.5", *reference,
             *run_flags("--micro_batch_size", "1", "--global_batch_size", "2")]
    if "lora" in reference:  # the adapters start at zero: a larger step moves them
        flags += ["--lr", "1e-2", "--min_lr", "1e-2"]
    train_in_process(tmp_path / "one", *flags, command="rlhf", base=[], trainer=DpoTrainer)
    env = child_env(NPROC_PER_NODE="2", MASTER_PORT=str(H.free_port()))
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "rlhf", *flags,
                           "--pipeline_model_parallel_size", "2", "--output_dir",
                           str(tmp_path / "pp2")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, pp2 = curve(tmp_path / "one"), curve(tmp_path / "pp2")
    assert sorted(one) == sorted(pp2) == [1, 2, 3]
    for it in one:
        for name in METRICS:
            # within 1e-5, or 1e-6 of the value for the summed log-probabilities (~40:
            # float32 holds them to ~4e-6)
            assert pp2[it][name] == pytest.approx(one[it][name], abs=1e-5, rel=1e-6), \
                (it, name)
        # a norm over every gradient: float32 sums in another order (rows padded to
        # --seq_length under stages) differ in the sixth digit
        assert pp2[it]["grad_norm"] == pytest.approx(one[it]["grad_norm"], rel=1e-5), it
    assert one[1]["logps/chosen"] != one[3]["logps/chosen"]  # it trained


@pytest.mark.benchmark
def test_packed_pipeline_parallel_gives_the_one_rank_losses(tiny_hf, tmp_path, gloo_group):
    """--packing under stages: each micro-batch packs into the rows it needs, the stages
    exchanging each shape; the losses are the one-rank unpacked run's."""
    from swift_mcore.training.rlhf_trainer import DpoTrainer

    folder, data = tiny_hf
    flags = ["--model", str(folder), "--dataset", str(data), "--train_iters", "3",
             "--no_save", "--rpo_alpha", "0.5",
             *run_flags("--micro_batch_size", "2", "--global_batch_size", "4",
                        "--seq_length", "32")]
    train_in_process(tmp_path / "one", *flags, command="rlhf", base=[], trainer=DpoTrainer)
    env = child_env(NPROC_PER_NODE="2", MASTER_PORT=str(H.free_port()))
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "rlhf", *flags, "--packing",
                           "--pipeline_model_parallel_size", "2", "--output_dir",
                           str(tmp_path / "pp2")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, pp2 = curve(tmp_path / "one"), curve(tmp_path / "pp2")
    assert sorted(one) == sorted(pp2) == [1, 2, 3]
    for it in one:
        for name in METRICS:
            assert pp2[it][name] == pytest.approx(one[it][name], abs=1e-5, rel=1e-6), \
                (it, name)
        assert pp2[it]["grad_norm"] == pytest.approx(one[it]["grad_norm"], rel=1e-5), it
    assert one[1]["logps/chosen"] != one[3]["logps/chosen"]  # it trained


@pytest.mark.parametrize("flags, message", [
    (["--rlhf_type", "kto", "--packing"], r"^--packing with --pipeline_model_parallel_size 2 "
                                          r"packs DPO's pairs only yet; --rlhf_type kto: drop "
                                          r"--packing$"),
    (["--packing", "--precompute_ref_log_probs"],
     r"^--packing with --precompute_ref_log_probs and --pipeline_model_parallel_size 2 is not "
     r"supported yet for rlhf; drop one of them$"),
])
def test_what_does_not_run_under_stages_is_refused(flags, message, tmp_path):
    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.errors import ArgumentError
    from swift_mcore.run_config import resolve

    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    argv = ["--dataset", str(data), "--output_dir", str(tmp_path / "o"),
            *run_flags("--pipeline_model_parallel_size", "2", *flags)]
    with pytest.raises(ArgumentError, match=message):
        resolve(parse_args(argv, prog="swift-mcore rlhf", cls=RlhfArguments), world_size=2)
