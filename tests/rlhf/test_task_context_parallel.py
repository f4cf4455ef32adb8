"""rlhf kto, rm, orpo and simpo, and dpo's --precompute_ref_log_probs, under context
parallelism: each sequence's parts summed over the CP ranks (KTO's KL rows cut like its
rows, ORPO's whole-row mask like the loss mask, a reward model's score read on the rank that
holds the sequence's last token) give the one-rank losses, metrics and gradient norms."""

import subprocess
import sys

import pytest

import hf_helpers as H
from in_process import train_in_process
from rlhf_helpers import ROWS, run_flags
from run_helpers import ROOT, child_env
from test_dpo_context_parallel import curve
from test_task_packing import TASK_FLAGS, margin_file, metric_names, trainer_of  # noqa: F401

# rows of 32 positions, every pair or row of the data in one micro-batch of two
FLAGS = ("--train_iters", "3", "--no_save", "--attention_dropout", "0", "--hidden_dropout",
         "0")


def run_cp2(out, *flags):
    env = child_env(NPROC_PER_NODE="2", MASTER_PORT=str(H.free_port()))
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "rlhf", *flags,
                           "--context_parallel_size", "2", "--output_dir", str(out)],
                          capture_output=True, text=True, timeout=400, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CP 2" in proc.stdout
    return proc


def assert_same_curves(one, cp, names):
    assert sorted(one) == sorted(cp) == [1, 2, 3]
    for it in one:
        for name in names:
            if one[it].get(name) is None:  # kto: a batch without one class has no metric
                assert cp[it].get(name) is None, (it, name)
                continue
            assert cp[it][name] == pytest.approx(one[it][name], abs=1e-5), (it, name)
    assert one[3]["loss"] != one[1]["loss"]  # it trained


@pytest.mark.benchmark
@pytest.mark.parametrize("task", ["kto", "rm", "orpo", "simpo"])
def test_each_task_at_cp2_gives_the_one_rank_run(task, tiny_hf, kto_file, margin_file,
                                                 tmp_path, gloo_group):
    folder = tiny_hf[0]
    data = {"kto": kto_file, "rm": margin_file}.get(task, tiny_hf[1])
    flags = ["--rlhf_type", task, "--model", str(folder), "--dataset", str(data), *FLAGS,
             *TASK_FLAGS[task], *run_flags("--micro_batch_size", "2", "--global_batch_size",
                                           "2", "--seq_length", "32")]
    train_in_process(tmp_path / "one", *flags, command="rlhf", base=[],
                     trainer=trainer_of(task))
    run_cp2(tmp_path / "cp", *flags)
    assert_same_curves(curve(tmp_path / "one"), curve(tmp_path / "cp"), metric_names(task))


@pytest.mark.benchmark
def test_dpo_s_precomputed_reference_at_cp2_gives_the_one_rank_run(tiny_hf, tmp_path,
                                                                   gloo_group):
    """The one pass before training runs each CP rank's chunks of the pairs: the stored
    table equals the one-rank table, and training from it the one-rank run."""
    from safetensors.torch import load_file

    from swift_mcore.training import ref_log_probs
    from swift_mcore.training.rlhf_trainer import DpoTrainer

    folder, data = tiny_hf
    flags = ["--rlhf_type", "dpo", "--model", str(folder), "--dataset", str(data), *FLAGS,
             "--precompute_ref_log_probs", *run_flags("--micro_batch_size", "2",
                                                      "--global_batch_size", "2",
                                                      "--seq_length", "32")]
    train_in_process(tmp_path / "one", *flags, command="rlhf", base=[], trainer=DpoTrainer)
    run_cp2(tmp_path / "cp", *flags)
    one, cp = (load_file(ref_log_probs.path_in(str(tmp_path / run)))["ref_logps"]
               for run in ("one", "cp"))
    assert one.shape == (len(ROWS), 2) and (cp - one).abs().max() <= 1e-5
    assert_same_curves(curve(tmp_path / "one"), curve(tmp_path / "cp"),
                       ("loss", "grad_norm", "rewards/chosen", "rewards/margins"))
