"""rlhf --packing under context parallelism: each packed row cut into the 2 x CP chunks as
sft's packed rows are, each sequence's sums (and a reward model's score, on the rank that
holds its last token) summed over the group, give the one-rank packed run's losses; a
packed CP=2 run resumes bit-exactly."""

import numpy as np
import pytest
import torch

from cp_helpers import (DPO_METRICS, FLAGS, as_rank, assert_same_curves, one_rank_and_cp2,
                        run_cp2)
from rlhf_helpers import run_flags
from test_task_packing import TASK_FLAGS, margin_file, metric_names, trainer_of  # noqa: F401


def ids(n, start):
    return np.arange(start, start + n, dtype=np.int32)


def test_a_packed_batch_cut_over_two_ranks_sums_to_the_whole(monkeypatch):
    """Two simulated CP ranks: a packed preference batch (pairs; KTO's rows and KL rows; a
    reward model's pairs) cut as the trainer cuts it gives, per sequence, log-probability
    sums and scores whose sum over the ranks is the whole row's, and masks whose query rows
    are the whole mask's."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    from swift_mcore.data.packing import block_causal_mask
    from swift_mcore.data.preference import PreferenceDataset
    from swift_mcore.data.reward_pairs import RewardPairs
    from swift_mcore.data.unpaired import UnpairedDataset
    from swift_mcore.training import reward_trainer
    from swift_mcore.training.rlhf_trainer import sequence_sums
    from swift_mcore.training.trainer import on_this_cp_rank

    monkeypatch.setattr(reward_trainer, "over_cp", lambda values: values)
    pairs = [(ids(3, 10), ids(4, 20), ids(2, 30)), (ids(2, 40), ids(5, 50), ids(3, 60)),
             (ids(4, 70), ids(1, 80), ids(6, 90))]
    unpaired = [(ids(3, 10), ids(4, 20), True), (ids(2, 40), ids(5, 50), False),
                (ids(5, 60), ids(2, 70), True)]
    datasets = {
        "dpo": PreferenceDataset(pairs, 16, "keep_start", 0, "f", pad_multiple=4, pack_to=16),
        "kto": UnpairedDataset(unpaired, 16, "keep_start", 0, "f", pad_multiple=4,
                               pack_to=16),
    }
    for name, ds in datasets.items():
        whole = ds.collate([ds[i] for i in range(3)])
        for prefix in ("", "kl_") if name == "kto" else ("",):
            seg = whole[prefix + "segment_ids"]
            assert seg.shape[1] % 4 == 0 and seg.shape[1] <= 16
            whole[prefix + "attention_mask"] = block_causal_mask(seg)
        values = {p: torch.randn(whole[p + "tokens"].shape, dtype=torch.float64)
                  for p in ("", "kl_") if p + "tokens" in whole}
        count = 6 if name == "dpo" else 3
        expect = {p: sequence_sums(v * whole[p + "loss_mask"], whole, count, p)
                  for p, v in values.items()}
        got = {p: 0 for p in values}
        for rank in range(2):
            as_rank(monkeypatch, rank)
            part = on_this_cp_rank(whole, 2)
            for p, v in values.items():
                assert part[p + "segment_ids"].shape[1] == whole[p + "segment_ids"].shape[1] // 2
                local = get_batch_on_this_cp_rank({"labels": v})["labels"] * part[p + "loss_mask"]
                got[p] = got[p] + sequence_sums(local, part, count, p)
                # the rank's queries (chunks rank and 3 - rank) see the whole row's keys, as
                # the whole mask says
                chunks = whole[p + "attention_mask"].chunk(4, dim=2)
                assert torch.equal(part[p + "attention_mask"],
                                   torch.cat([chunks[rank], chunks[3 - rank]], dim=2))
        for p in values:
            assert torch.allclose(got[p], expect[p], rtol=0, atol=1e-12), (name, p)
            assert bool((expect[p] != 0).all()), (name, p)  # every sequence has a value

    # a reward model: each sequence's score read on the rank that holds its last token
    reward = [(ids(5, 10), ids(3, 20), 0.0), (ids(2, 30), ids(7, 40), 1.0),
              (ids(4, 50), ids(6, 60), 0.5)]
    ds = RewardPairs(reward, 0, "f", True, pad_multiple=4, pack_to=16)
    whole = ds.collate([ds[i] for i in range(3)])
    scores = torch.randn(*whole["tokens"].shape, 1, dtype=torch.float64)
    where = whole["score_index"]
    expect = scores[where[:, 0], where[:, 1], 0]
    got, holders = 0, []
    for rank in range(2):
        as_rank(monkeypatch, rank)
        local = on_this_cp_rank({"tokens": whole["tokens"], "labels": scores[..., 0]}, 2)
        part = reward_trainer.packed_scores_over_cp(local["labels"][..., None], where)
        holders.append(part != 0)
        got = got + part
    assert torch.equal(got, expect)
    # each score comes from exactly one rank, and both ranks hold some
    assert torch.equal(holders[0] ^ holders[1], torch.ones(6, dtype=torch.bool))
    assert bool(holders[0].any()) and bool(holders[1].any())


# each task's flags, every part of its loss on (dpo: the sft term's sum over chosen tokens
# and ipo's division by the answers' lengths; its precomputed reference: the pass before
# training over the packed rows, cut over the group too)
PACKED_TASKS = {
    "dpo": ("--rlhf_type", "dpo", "--rpo_alpha", "0.5", "--loss_type", "sigmoid,ipo"),
    "dpo_precompute": ("--rlhf_type", "dpo", "--precompute_ref_log_probs"),
    **{task: ("--rlhf_type", task, *TASK_FLAGS[task]) for task in ("kto", "rm", "orpo",
                                                                    "simpo")},
}


@pytest.mark.benchmark
@pytest.mark.parametrize("task", sorted(PACKED_TASKS))
def test_each_packed_task_at_cp2_gives_the_one_rank_packed_run(task, tiny_hf, kto_file,
                                                               margin_file, tmp_path,
                                                               gloo_group):
    kind = task.split("_")[0]
    folder = tiny_hf[0]
    data = {"kto": kto_file, "rm": margin_file}.get(kind, tiny_hf[1])
    flags = ["--model", str(folder), "--dataset", str(data), *FLAGS, *PACKED_TASKS[task],
             "--packing", *run_flags("--micro_batch_size", "2", "--global_batch_size", "2",
                                     "--seq_length", "32")]
    from swift_mcore.training.rlhf_trainer import DpoTrainer

    trainer = DpoTrainer if kind == "dpo" else trainer_of(kind)
    one, cp, proc = one_rank_and_cp2(tmp_path, flags, trainer)
    assert "--packing: each micro-batch's sequences end to end" in proc.stdout
    assert_same_curves(one, cp, DPO_METRICS if kind == "dpo" else metric_names(kind))


def run_cp2_resumable(out, folder, data, *flags):
    """A real two-rank CP run of test_rlhf_resume's DPO (its checkpoints saved)."""
    from test_rlhf_resume import argv

    return run_cp2(out, *argv(folder, data, "--packing", "--attention_dropout", "0",
                              "--hidden_dropout", "0", *flags))


@pytest.mark.benchmark
def test_a_packed_dpo_run_at_cp2_resumes_bit_exactly(tiny_hf, tmp_path):
    from test_rlhf_resume import trained

    folder, data = tiny_hf
    run_cp2_resumable(tmp_path / "whole", folder, data)
    split = tmp_path / "split"
    run_cp2_resumable(split, folder, data, "--exit_interval", "2")
    assert sorted(trained(split)) == [1, 2]
    proc = run_cp2_resumable(split, folder, data, "--resume")
    assert "starting at iteration 2" in proc.stdout
    whole = trained(tmp_path / "whole")
    assert sorted(whole) == [1, 2, 3, 4]
    assert trained(split) == whole  # bit-equal, the metrics included


@pytest.mark.benchmark
def test_packed_dpo_at_cp2_with_pp2_on_four_ranks_gives_the_one_rank_packed_run(
        tiny_hf, tmp_path, gloo_group):
    """CP=2 x PP=2: the stages send each other the shape of each CP rank's part of the
    packed rows (the policy's and the reference's side by side); the last stage sums each
    sequence over the group."""
    from swift_mcore.training.rlhf_trainer import DpoTrainer

    folder, data = tiny_hf
    flags = ["--model", str(folder), "--dataset", str(data), *FLAGS, *PACKED_TASKS["dpo"],
             "--packing", *run_flags("--micro_batch_size", "1", "--global_batch_size", "2",
                                     "--seq_length", "32")]
    one, four, proc = one_rank_and_cp2(tmp_path, flags, DpoTrainer, stages=2)
    assert "--packing: each micro-batch's sequences end to end" in proc.stdout
    assert_same_curves(one, four, [n for n in DPO_METRICS if n != "grad_norm"])
    for it in one:  # the stages' float32 gradient sums in another order (as unpacked)
        assert four[it]["grad_norm"] == pytest.approx(one[it]["grad_norm"], rel=1e-5), it
