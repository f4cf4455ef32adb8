"""rlhf --packing for kto, rm, orpo and simpo: a packed run's per-step losses and metrics
are the unpacked run's; the rows keep each sequence apart (KTO's KL rows packed apart from
its rows, a reward model's score read at each sequence's last token); a packed KTO run
resumes bit-exactly."""

import json

import numpy as np
import pytest
import torch

from in_process import train_in_process
from reward_helpers import MARGIN_ROWS
from rlhf_helpers import run_flags
from test_rlhf_resume import records


def trainer_of(task):
    if task == "kto":
        from swift_mcore.training.kto_trainer import KtoTrainer
        return KtoTrainer
    if task == "rm":
        from swift_mcore.training.reward_trainer import RewardTrainer
        return RewardTrainer
    from swift_mcore.training.reference_free_trainer import ReferenceFreeTrainer
    return ReferenceFreeTrainer


def metric_names(task):
    from swift_mcore.training import kto_loss, reference_free_loss, reward_loss

    names = {"kto": kto_loss.METRICS, "rm": (*reward_loss.METRICS, *reward_loss.EXTREMES),
             "orpo": reference_free_loss.ORPO_METRICS,
             "simpo": reference_free_loss.SIMPO_METRICS}[task]
    return ("loss", "grad_norm", *names)


# each task's own flags, chosen so that every part of its loss is on
TASK_FLAGS = {
    "kto": ("--undesirable_weight", "1.5"),
    "rm": ("--center_rewards_coefficient", "0.01"),
    "orpo": ("--beta", "0.5"),
    "simpo": ("--simpo_gamma", "0.3", "--cpo_alpha", "0.5", "--label_smoothing", "0.1"),
}


@pytest.fixture(scope="module")
def margin_file(tiny_hf):
    data = tiny_hf[1].parent / "margin_prefs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in MARGIN_ROWS))
    return data


PACKED = "--packing: each micro-batch's sequences end to end in rows of 32 positions"


def run(task, out, folder, data, *flags):
    proc = train_in_process(out, "--model", folder, "--dataset", data, "--rlhf_type", task,
                     "--train_iters", "3", *TASK_FLAGS[task],
                     *run_flags("--micro_batch_size", "2", "--global_batch_size", "2",
                                "--seq_length", "32", *flags),
                     command="rlhf", base=[], trainer=trainer_of(task))
    # the data the run trained on was laid out as the flag says
    assert (PACKED in proc.stdout) == ("--packing" in flags)
    names = metric_names(task)
    return {r["iteration"]: {k: r.get(k) for k in names} for r in records(out) if "loss" in r}


@pytest.mark.parametrize("task", ["kto", "rm", "orpo", "simpo"])
def test_packed_rows_give_the_unpacked_losses(task, tiny_hf, kto_file, margin_file, tmp_path,
                                              gloo_group):
    folder = tiny_hf[0]
    data = {"kto": kto_file, "rm": margin_file}.get(task, tiny_hf[1])
    padded = run(task, tmp_path / "padded", folder, data)
    packed = run(task, tmp_path / "packed", folder, data, "--packing")
    assert sorted(padded) == sorted(packed) == [1, 2, 3]
    for it in padded:
        for name in metric_names(task):
            if padded[it][name] is None:  # kto: a batch without one class has no metric
                assert task == "kto" and name != "loss" and packed[it][name] is None
                continue
            assert packed[it][name] == pytest.approx(padded[it][name], abs=1e-5, rel=0), \
                (it, name)
    # the policy moved (the equality is of trained steps, not of a model left as it was)
    assert padded[1]["loss"] != padded[3]["loss"]


def ids(n, start):
    return np.arange(start, start + n, dtype=np.int32)


def test_kto_packs_its_rows_and_its_kl_rows_apart():
    from swift_mcore.data.unpaired import UnpairedDataset

    # row 0: prompt 3 + completion 4 tokens; row 1: prompt 2 + completion 5
    encoded = [(ids(3, 10), ids(4, 20), True), (ids(2, 40), ids(5, 50), False)]
    packed = UnpairedDataset(encoded, 16, "keep_start", 0, "f", pack_to=12)
    plain = UnpairedDataset(encoded, 16, "keep_start", 0, "f")
    batch = packed.collate([packed[0], packed[1]])
    rows = plain.collate([plain[0], plain[1]])
    for prefix in ("", "kl_"):
        seg = batch[prefix + "segment_ids"]
        assert seg.shape == (1, 12)  # both sequences (6 positions each) in one row
        for k in range(2):
            where = seg == k
            n = int(where.sum())
            assert batch[prefix + "position_ids"][where].tolist() == list(range(n))
            for name in ("tokens", "labels", "loss_mask"):
                assert batch[prefix + name][where].tolist() == \
                    rows[prefix + name][k, :n].tolist(), (prefix, name, k)
        assert torch.equal(batch[prefix + "num_tokens"], rows[prefix + "num_tokens"])
    # the KL rows are row i's prompt with row i-1's answer, packed on their own
    assert batch["kl_tokens"][batch["kl_segment_ids"] == 0][:3].tolist() == [10, 11, 12]
    assert batch["kl_labels"][batch["kl_segment_ids"] == 0][2:].tolist() == \
        [50, 51, 52, 53, 54]


def test_reward_pairs_pack_whole_sequences_and_read_each_score_at_its_last_token():
    from swift_mcore.data.reward_pairs import RewardPairs
    from swift_mcore.models.value_head import last_token_index

    pad = 0
    # the pad token ends a sequence (the EOS as pad, TRL's choice): the score is read
    # before it, as in the sequence's own padded row
    encoded = [(np.array([5, 6, 7, pad], np.int32), np.array([5, 8], np.int32), 0.5),
               (np.array([9, 10, 11], np.int32), np.array([9, 12, 13, 14, 15], np.int32), 0.0)]
    packed = RewardPairs(encoded, pad, "f", True, pack_to=8)
    plain = RewardPairs(encoded, pad, "f", True)
    batch = packed.collate([packed[0], packed[1]])
    rows = plain.collate([plain[0], plain[1]])
    seg = batch["segment_ids"]
    assert seg.shape[0] == 2 and seg.shape[1] <= 8
    expected = last_token_index(rows["tokens"], pad)
    for k in range(4):
        where = seg == k
        n = int(where.sum())
        assert n == len(encoded[k % 2][k // 2])  # a reward model reads every token
        assert batch["tokens"][where].tolist() == rows["tokens"][k, :n].tolist()
        assert batch["position_ids"][where].tolist() == list(range(n))
        row, col = batch["score_index"][k].tolist()
        assert seg[row, col] == k
        assert int(batch["position_ids"][row, col]) == int(expected[k])
    assert torch.equal(batch["margin"], rows["margin"])
    assert torch.equal(batch["num_tokens"], rows["num_tokens"])


@pytest.mark.slow
def test_a_packed_kto_run_resumes_bit_exactly(tiny_hf, kto_file, tmp_path, gloo_group):
    from swift_mcore.errors import CheckpointError
    from swift_mcore.runtime import run_lock
    from swift_mcore.training.kto_trainer import KtoTrainer
    from test_kto_runs import argv, rlhf, trained

    folder = tiny_hf[0]
    train_in_process(tmp_path / "whole", *argv(folder, kto_file, "--packing"),
                     command="rlhf", base=[], trainer=KtoTrainer)
    split = tmp_path / "split"
    train_in_process(split, *argv(folder, kto_file, "--packing", "--exit_interval", "2"),
                     command="rlhf", base=[], trainer=KtoTrainer)
    assert sorted(trained(split)) == [1, 2]
    with pytest.raises(CheckpointError, match=r"training data \(content fingerprint\)"):
        train_in_process(split, *argv(folder, kto_file, "--resume"), command="rlhf", base=[],
                         trainer=KtoTrainer)  # the same rows, unpacked
    run_lock.release(str(split))
    # the resume checked for exactness is a real process
    proc = rlhf(split, folder, kto_file, "--packing", "--resume")
    assert "starting at iteration 2" in proc.stdout
    whole = trained(tmp_path / "whole")
    assert sorted(whole) == [1, 2, 3, 4]
    assert trained(split) == whole  # bit-equal, the metrics included
