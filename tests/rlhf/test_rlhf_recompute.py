"""rlhf with activation recompute: recomputing whole layers in the backward pass changes no
number of a preference run (the policy's graph is rebuilt; the reference and KTO's KL rows
run without one)."""

import pytest

from in_process import train_in_process
from rlhf_helpers import run_flags
from test_rlhf_resume import records
from test_task_packing import TASK_FLAGS, metric_names, trainer_of

RECOMPUTE = ("--recompute_granularity", "full", "--recompute_method", "uniform",
             "--recompute_num_layers", "1")


def run(task, out, folder, data, *flags):
    from swift_mcore.training.rlhf_trainer import DpoTrainer

    trainer = DpoTrainer if task == "dpo" else trainer_of(task)
    proc = train_in_process(out, "--model", folder, "--dataset", data, "--rlhf_type", task,
                     "--train_iters", "3", *TASK_FLAGS.get(task, ("--rpo_alpha", "0.5")),
                     *run_flags("--micro_batch_size", "2", "--global_batch_size", "2",
                                "--seq_length", "32", *flags),
                     command="rlhf", base=[], trainer=trainer)
    # the run recomputed as asked (the decision megatron's TransformerConfig is built from)
    said = "activation recompute full (uniform, 1 layer)" in proc.stdout
    assert said == (RECOMPUTE[0] in flags), proc.stdout[-2000:]
    names = ("loss", "grad_norm") if task == "dpo" else metric_names(task)
    return {r["iteration"]: {k: r.get(k) for k in names} for r in records(out) if "loss" in r}


@pytest.mark.parametrize("task", ["dpo", "kto"])
def test_recompute_gives_the_same_losses(task, tiny_hf, kto_file, tmp_path, gloo_group):
    folder = tiny_hf[0]
    data = kto_file if task == "kto" else tiny_hf[1]
    plain = run(task, tmp_path / "plain", folder, data)
    recomputed = run(task, tmp_path / "recompute", folder, data, *RECOMPUTE)
    assert sorted(plain) == sorted(recomputed) == [1, 2, 3]
    for it in plain:
        for name, value in plain[it].items():
            if value is None:  # kto: a batch without one class has no such metric
                assert recomputed[it][name] is None
            else:
                assert recomputed[it][name] == pytest.approx(value, rel=1e-6, abs=1e-7), \
                    (it, name)
