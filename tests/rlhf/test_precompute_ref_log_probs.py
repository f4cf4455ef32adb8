"""--precompute_ref_log_probs: one pass before training stores the reference's
log-probabilities in the run folder (fingerprinted safetensors); training with them equals
training with the reference model, a resume reuses the file, and a file computed for other
data or another reference is refused naming the flag, left as it was."""

import subprocess
import sys

import pytest

from in_process import train_in_process
from rlhf_helpers import run_flags
from run_helpers import ROOT, child_env
from test_rlhf_resume import records

KEEP = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
        "rewards/margins", "logps/chosen", "logps/rejected", "nll_loss", "grad_norm")


def argv(folder, data, *flags):
    return ["--model", str(folder), "--dataset", str(data), "--train_iters", "4",
            "--rpo_alpha", "0.5", *run_flags("--micro_batch_size", "2", *map(str, flags))]


def trained(out):
    return {r["iteration"]: {k: r.get(k) for k in KEEP} for r in records(out) if "loss" in r}


def here(out, folder, data, *flags):
    from swift_mcore.training.rlhf_trainer import DpoTrainer

    return train_in_process(out, *argv(folder, data, *flags), command="rlhf", base=[],
                            trainer=DpoTrainer)


def rlhf(out, folder, data, *flags):
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "rlhf",
                           "--output_dir", str(out), *argv(folder, data, *flags)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_precomputed_equals_the_reference_model_and_resume_reuses_the_file(
        tiny_hf, tmp_path, gloo_group):
    from safetensors import safe_open

    from swift_mcore.training import ref_log_probs

    folder, data = tiny_hf
    here(tmp_path / "live", folder, data)
    split = tmp_path / "split"
    # the first half may run here: the resume, checked for exactness, is a real process
    proc = here(split, folder, data, "--precompute_ref_log_probs", "--exit_interval", "2")
    assert "reference log-probabilities of 4 pairs computed and stored" in proc.stdout
    stored = split / ref_log_probs.FILE
    with safe_open(str(stored), "pt") as f:
        assert f.get_tensor("ref_logps").shape == (4, 2)
        fingerprint = f.metadata()[ref_log_probs.MAGIC_KEY]
    assert len(fingerprint) > 64  # the data's and the reference's
    before = stored.read_bytes()
    proc = rlhf(split, folder, data, "--precompute_ref_log_probs", "--resume")
    assert "starting at iteration 2" in proc.stdout
    assert "reference log-probabilities of 4 pairs read from" in proc.stdout
    assert stored.read_bytes() == before
    live, precomputed = trained(tmp_path / "live"), trained(split)
    assert sorted(live) == sorted(precomputed) == [1, 2, 3, 4]
    assert precomputed == live  # bit for bit, the metrics included


def test_a_file_of_other_data_is_refused_naming_the_flag(tiny_hf, tmp_path, gloo_group):
    import torch

    from swift_mcore.errors import ArgumentError
    from swift_mcore.runtime import run_lock
    from swift_mcore.training import ref_log_probs

    folder, data = tiny_hf
    out = tmp_path / "run"
    out.mkdir()
    planted = out / ref_log_probs.FILE
    ref_log_probs.write(str(planted), torch.zeros(4, 2), "f" * 128)
    before = planted.read_bytes()
    with pytest.raises(ArgumentError, match=r"^--precompute_ref_log_probs: .*ref_logps\."
                                            r"safetensors was computed for other data or "
                                            r"another reference \(fingerprint ffff"):
        here(out, folder, data, "--precompute_ref_log_probs")
    run_lock.release(str(out))
    assert planted.read_bytes() == before
    assert not (out / "metrics.jsonl").exists() or not trained(out)
    planted.write_bytes(b"not safetensors")
    with pytest.raises(ArgumentError, match=r"^--precompute_ref_log_probs: .* not a reference "
                                            r"log-probability file written by swift-mcore"):
        here(out, folder, data, "--precompute_ref_log_probs")
    run_lock.release(str(out))
    assert planted.read_bytes() == b"not safetensors"
    # a link planted at the name is never written through
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    planted.unlink()
    planted.symlink_to(victim)
    with pytest.raises(ArgumentError, match=r"^--precompute_ref_log_probs: .* not a reference "
                                            r"log-probability file"):
        here(out, folder, data, "--precompute_ref_log_probs")
    run_lock.release(str(out))
    assert victim.read_bytes() == b"keep me" and planted.is_symlink()


def test_a_cut_or_non_finite_file_is_refused_naming_the_flag(tmp_path):
    """A file cut short raised safetensors' SafetensorError as a traceback; one edited to
    hold nan trained nan losses."""
    import torch

    from swift_mcore.errors import ArgumentError
    from swift_mcore.training import ref_log_probs

    path = tmp_path / ref_log_probs.FILE
    ref_log_probs.write(str(path), torch.zeros(4, 2), "f" * 64)
    assert torch.equal(ref_log_probs.read(str(path), "f" * 64, 4), torch.zeros(4, 2))
    whole = path.read_bytes()
    path.write_bytes(whole[:-8])
    with pytest.raises(ArgumentError, match=r"^--precompute_ref_log_probs: .* not a reference "
                                            r"log-probability file written by swift-mcore "
                                            r"\(SafetensorError\); remove it$"):
        ref_log_probs.read(str(path), "f" * 64, 4)
    table = torch.zeros(4, 2)
    table[2, 1] = float("nan")
    ref_log_probs.write(str(path), table, "f" * 64)
    with pytest.raises(ArgumentError, match=r"^--precompute_ref_log_probs: .* holds nan or "
                                            r"inf; remove it"):
        ref_log_probs.read(str(path), "f" * 64, 4)
