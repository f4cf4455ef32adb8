"""KTO runs end to end: a stopped and resumed run equals a straight one bit for bit (the
metrics included), LoRA's implicit reference (adapters off) is the base model, and TP=2
gives the one-rank losses."""

import subprocess
import sys

import pytest

from in_process import train_in_process
from rlhf_helpers import run_flags
from run_helpers import ROOT, child_env
from test_dpo_lora_reference import one_step
from test_rlhf_resume import records


def argv(folder, data, *flags):
    return ["--model", str(folder), "--dataset", str(data), "--rlhf_type", "kto",
            "--train_iters", "4", "--undesirable_weight", "1.5",
            *run_flags("--micro_batch_size", "2", *map(str, flags))]


def trained(out):
    keep = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
            "logps/rejected", "kl", "grad_norm")
    return {r["iteration"]: {k: r.get(k) for k in keep} for r in records(out) if "loss" in r}


def rlhf(out, folder, data, *flags):
    """A real process: what a resume checked for exactness must start from."""
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "rlhf",
                           "--output_dir", str(out), *argv(folder, data, *flags)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_resume_is_bit_exact_and_another_reference_is_refused(tiny_hf, kto_file, tmp_path,
                                                             gloo_group):
    import hf_helpers as H

    from swift_mcore.errors import CheckpointError
    from swift_mcore.runtime import run_lock
    from swift_mcore.training.kto_trainer import KtoTrainer

    folder = tiny_hf[0]
    train_in_process(tmp_path / "whole", *argv(folder, kto_file), command="rlhf", base=[],
                     trainer=KtoTrainer)
    split = tmp_path / "split"
    proc = rlhf(split, folder, kto_file, "--exit_interval", "2")
    assert "rewards/chosen" in proc.stdout and "| kl " in proc.stdout  # TRL's names
    assert sorted(trained(split)) == [1, 2]
    # the checkpoint records the reference it was trained against
    other = tmp_path / "other"
    H.make_model(str(other), "llama", seed=1, initializer_range=0.02)
    with pytest.raises(CheckpointError, match=r"reference model \(--ref_model, or the "
                                              r"starting weights of --model\): checkpoint "
                                              r"sha256:\w+, now sha256:\w+"):
        train_in_process(split, *argv(folder, kto_file, "--resume", "--ref_model", other),
                         command="rlhf", base=[], trainer=KtoTrainer)
    run_lock.release(str(split))  # as the command does when it ends (cli.run_training)
    assert sorted(trained(split)) == [1, 2]  # nothing trained, nothing lost
    proc = rlhf(split, folder, kto_file, "--resume")
    assert "starting at iteration 2" in proc.stdout
    whole = trained(tmp_path / "whole")
    assert sorted(whole) == [1, 2, 3, 4]
    assert all(v is not None for row in whole.values() for v in row.values())
    assert trained(split) == whole  # bit-equal, the metrics included
    assert whole[4]["rewards/margins"] > whole[1]["rewards/margins"]


def lora_kto(folder, data, out, *extra):
    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.run_config import resolve
    from swift_mcore.training.kto_trainer import KtoTrainer

    flags = ["--model", str(folder), "--dataset", str(data), "--output_dir", str(out),
             "--rlhf_type", "kto", "--train_iters", "1", "--no_save", "--tuner_type", "lora",
             "--lora_rank", "4", *run_flags(*extra)]
    trainer = KtoTrainer(resolve(parse_args(flags, prog="swift-mcore rlhf", cls=RlhfArguments),
                                 world_size=1))
    trainer.setup()
    return trainer


def test_lora_implicit_reference_equals_the_base_as_ref_model(tiny_hf, kto_file, tmp_path,
                                                              gloo_group):
    folder = tiny_hf[0]
    implicit, grads, no_copy, metrics = one_step(lora_kto(folder, kto_file, tmp_path / "a"))
    explicit, ref_grads, copy, ref_metrics = one_step(
        lora_kto(folder, kto_file, tmp_path / "b", "--ref_model", str(folder)))
    assert no_copy is None and copy is not None  # the implicit reference is no second model
    # the adapters move the policy away from its reference
    assert abs(metrics["rewards/chosen"]) > 1e-2 and abs(metrics["rewards/rejected"]) > 1e-2
    assert implicit == pytest.approx(explicit, abs=1e-6)
    for name in metrics:
        assert metrics[name] == pytest.approx(ref_metrics[name], abs=1e-6), name
    assert sorted(grads) == sorted(ref_grads) and grads
    for name in grads:
        assert (grads[name] - ref_grads[name]).abs().max().item() <= 1e-6, name


@pytest.mark.benchmark
def test_tensor_parallel_gives_the_one_rank_losses(tiny_hf, kto_file, tmp_path, gloo_group):
    import hf_helpers as H
    from test_rlhf_parallel import curve

    from swift_mcore.training.kto_trainer import KtoTrainer

    flags = argv(tiny_hf[0], kto_file, "--no_save")
    flags[flags.index("--train_iters") + 1] = "2"
    train_in_process(tmp_path / "one", *flags, command="rlhf", base=[], trainer=KtoTrainer)
    env = child_env(NPROC_PER_NODE="2", MASTER_PORT=str(H.free_port()))
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "rlhf", *flags,
                           "--tensor_model_parallel_size", "2", "--output_dir",
                           str(tmp_path / "tp2")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, tp2 = curve(tmp_path / "one"), curve(tmp_path / "tp2")
    assert sorted(one) == sorted(tp2) == [1, 2]
    for it in one:
        for name in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen",
                     "logps/rejected", "kl"):
            assert tp2[it][name] == pytest.approx(one[it][name], abs=1e-5), (it, name)
