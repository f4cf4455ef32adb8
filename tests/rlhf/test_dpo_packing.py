"""rlhf --packing (dpo): a micro-batch's chosen and rejected sequences laid end to end in
--seq_length rows give the unpacked run's losses and metrics; the rows keep each sequence
apart (segment ids, position ids restarting). The other tasks: test_task_packing.py."""

import numpy as np
import pytest
import torch

from in_process import train_in_process
from rlhf_helpers import run_flags
from test_rlhf_resume import records

KEEP = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
        "rewards/margins", "logps/chosen", "logps/rejected", "nll_loss", "grad_norm")


def run(out, folder, data, *flags):
    from swift_mcore.training.rlhf_trainer import DpoTrainer

    train_in_process(out, "--model", folder, "--dataset", data, "--train_iters", "3",
                     "--rpo_alpha", "0.5", "--loss_type", "sigmoid,ipo",
                     *run_flags("--micro_batch_size", "2", "--global_batch_size", "2",
                                "--seq_length", "32", *flags),
                     command="rlhf", base=[], trainer=DpoTrainer)
    return {r["iteration"]: {k: r.get(k) for k in KEEP}
            for r in records(out) if "loss" in r}


def fingerprint(out):
    from safetensors import safe_open

    from swift_mcore.training import ref_log_probs

    with safe_open(str(out / ref_log_probs.FILE), "pt") as f:
        return f.metadata()[ref_log_probs.MAGIC_KEY]


def test_packed_rows_give_the_unpacked_losses(tiny_hf, tmp_path, gloo_group):
    folder, data = tiny_hf
    padded = run(tmp_path / "padded", folder, data, "--precompute_ref_log_probs")
    packed = run(tmp_path / "packed", folder, data, "--packing")
    # the reference's log-probabilities computed from packed rows too
    precomputed = run(tmp_path / "packed_pre", folder, data, "--packing",
                      "--precompute_ref_log_probs")
    assert sorted(padded) == sorted(packed) == sorted(precomputed) == [1, 2, 3]
    for it in padded:
        for name in KEEP:
            for other in (packed, precomputed):
                assert other[it][name] == pytest.approx(padded[it][name], abs=1e-5, rel=0), \
                    (it, name)
    # packed rows are other data to a checkpoint or a stored reference table
    assert fingerprint(tmp_path / "padded") != fingerprint(tmp_path / "packed_pre")
    # the policy moved (the equality is of trained steps, not of a model left as it was)
    assert padded[1]["logps/chosen"] != padded[3]["logps/chosen"]


def test_collate_lays_sequences_end_to_end_in_rows():
    from swift_mcore.data.preference import PreferenceDataset

    def ids(n, start):
        return np.arange(start, start + n, dtype=np.int32)

    # pair 0: prompt 3, chosen 4, rejected 2 tokens; pair 1: prompt 2, chosen 5, rejected 3
    encoded = [(ids(3, 10), ids(4, 20), ids(2, 30)), (ids(2, 40), ids(5, 50), ids(3, 60))]
    ds = PreferenceDataset(encoded, max_length=16, truncation_mode="keep_start", pad_id=0,
                           fingerprint="f", pack_to=12)
    padded = PreferenceDataset(encoded, 16, "keep_start", 0, "f")
    batch = ds.collate([ds[0], ds[1]])
    plain = padded.collate([padded[0], padded[1]])
    seg = batch["segment_ids"]
    # sequences (positions = tokens - 1): chosen 6, 6; rejected 4, 4 -> rows of 12 and 8
    assert seg.shape == (2, 12)
    lengths = {k: int((seg == k).sum()) for k in range(4)}
    assert lengths == {0: 6, 1: 6, 2: 4, 3: 4}
    for k in range(4):
        where = seg == k
        assert batch["position_ids"][where].tolist() == list(range(lengths[k]))
        row = plain["tokens"][k, :lengths[k]]
        assert batch["tokens"][where].tolist() == row.tolist()
        assert batch["labels"][where].tolist() == plain["labels"][k, :lengths[k]].tolist()
        assert batch["loss_mask"][where].tolist() == plain["loss_mask"][k, :lengths[k]].tolist()
    assert not batch["loss_mask"][seg < 0].any()
    for name in ("completion_lengths", "num_tokens", "pair_index"):
        assert torch.equal(batch[name], plain[name])


@pytest.mark.slow
def test_a_packed_run_resumes_bit_exactly_and_refuses_unpacked_rows(tiny_hf, tmp_path,
                                                                    gloo_group):
    from swift_mcore.errors import CheckpointError
    from swift_mcore.runtime import run_lock
    from test_rlhf_resume import rlhf, rlhf_here, trained

    folder, data = tiny_hf
    rlhf_here(tmp_path / "whole", folder, data, "--packing")
    split = tmp_path / "split"
    rlhf_here(split, folder, data, "--packing", "--exit_interval", "2")
    assert sorted(trained(split)) == [1, 2]
    with pytest.raises(CheckpointError, match=r"training data \(content fingerprint\)"):
        rlhf_here(split, folder, data, "--resume")  # the same pairs, unpacked
    run_lock.release(str(split))
    # the resume checked for exactness is a real process
    proc = rlhf(split, folder, data, "--packing", "--resume")
    assert "starting at iteration 2" in proc.stdout
    whole = trained(tmp_path / "whole")
    assert sorted(whole) == [1, 2, 3, 4]
    assert trained(split) == whole  # bit-equal, the metrics included
