"""rlhf kto, rm, orpo and simpo, and dpo's --precompute_ref_log_probs, under context
parallelism: each sequence's parts summed over the CP ranks (KTO's KL rows cut like its
rows, ORPO's whole-row mask like the loss mask, a reward model's score read on the rank that
holds the sequence's last token) give the one-rank losses, metrics and gradient norms."""

import pytest

from cp_helpers import FLAGS, as_rank, assert_same_curves, one_rank_and_cp2
from rlhf_helpers import ROWS, run_flags
from test_task_packing import TASK_FLAGS, margin_file, metric_names, trainer_of  # noqa: F401


@pytest.mark.benchmark
@pytest.mark.parametrize("task", ["kto", "rm", "orpo", "simpo"])
def test_each_task_at_cp2_gives_the_one_rank_run(task, tiny_hf, kto_file, margin_file,
                                                 tmp_path, gloo_group):
    folder = tiny_hf[0]
    data = {"kto": kto_file, "rm": margin_file}.get(task, tiny_hf[1])
    flags = ["--rlhf_type", task, "--model", str(folder), "--dataset", str(data), *FLAGS,
             *TASK_FLAGS[task], *run_flags("--micro_batch_size", "2", "--global_batch_size",
                                           "2", "--seq_length", "32")]
    one, cp, _ = one_rank_and_cp2(tmp_path, flags, trainer_of(task))
    assert_same_curves(one, cp, metric_names(task))


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
    one, cp, _ = one_rank_and_cp2(tmp_path, flags, DpoTrainer)
    one_table, cp_table = (load_file(ref_log_probs.path_in(str(tmp_path / run)))["ref_logps"]
                           for run in ("one", "cp"))
    assert one_table.shape == (len(ROWS), 2) and (cp_table - one_table).abs().max() <= 1e-5
    assert_same_curves(one, cp, ("loss", "grad_norm", "rewards/chosen", "rewards/margins"))


WITH_STAGES = {
    "dpo": ["--rlhf_type", "dpo", "--rpo_alpha", "0.5", "--micro_batch_size", "1",
            "--global_batch_size", "2"],
    "kto": ["--rlhf_type", "kto", "--micro_batch_size", "2", "--global_batch_size", "4"],
    "rm": ["--rlhf_type", "rm", "--micro_batch_size", "1", "--global_batch_size", "2"],
    # the pass before training through the stages, each CP rank with its chunks
    "dpo_precompute": ["--precompute_ref_log_probs", "--micro_batch_size", "3",
                       "--global_batch_size", "3"],
}


@pytest.mark.benchmark
@pytest.mark.parametrize("task", sorted(WITH_STAGES))
def test_cp2_with_pp2_on_four_ranks_gives_the_one_rank_run(task, tiny_hf, kto_file, tmp_path,
                                                           gloo_group):
    """CP=2 x PP=2: the stages pass each CP rank's part of the policy's, the reference's
    (and KTO's KL) rows; the last stage sums each sequence over the group."""
    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.cli import trainer_class
    from swift_mcore.run_config import resolve
    from test_rlhf_pipeline import task_metrics

    folder, data = tiny_hf
    flags = ["--model", str(folder), "--dataset", str(kto_file if task == "kto" else data),
             *FLAGS, *run_flags(*WITH_STAGES[task])]
    config = resolve(parse_args([*flags, "--output_dir", str(tmp_path / "one")],
                                prog="swift-mcore rlhf", cls=RlhfArguments), world_size=1)
    one, four, _ = one_rank_and_cp2(tmp_path, flags, trainer_class(config), stages=2)
    assert sorted(one) == sorted(four) == [1, 2, 3]
    names = ("loss", *task_metrics(config.rlhf.rlhf_type))
    for it in one:
        assert [n for n in names if n in four[it]] == [n for n in names if n in one[it]], it
        for name in (n for n in names if n in one[it]):
            assert four[it][name] == pytest.approx(one[it][name], abs=1e-5, rel=1e-6), \
                (it, name)
        # rows padded to --seq_length under stages: float32 sums in another order
        assert four[it]["grad_norm"] == pytest.approx(one[it]["grad_norm"], rel=1e-5), it


def test_a_reward_score_is_read_on_the_rank_that_holds_the_last_token(monkeypatch):
    """Two simulated CP ranks: each rank's part (its chunks of the rows), summed, is the
    score pooled at each whole row's last non-pad token; the position the ranks agree on is
    the largest of their own candidates (a row of pads: position 0, on rank 0)."""
    import torch
    from megatron.core.utils import get_batch_on_this_cp_rank

    from swift_mcore.models.value_head import pooled
    from swift_mcore.runtime import collectives
    from swift_mcore.training import reward_trainer

    pad = 0
    tokens = torch.tensor([[5, 6, 7, 0, 0, 0, 0, 0],   # last token at 2: chunk 1, rank 1
                           [5, 6, 7, 8, 9, 0, 0, 0],   # at 4: chunk 2, rank 1
                           [5, 6, 7, 8, 9, 9, 9, 9],   # at 7: chunk 3, rank 0
                           [0, 0, 0, 0, 0, 0, 0, 0]])  # none: position 0, rank 0
    scores = torch.randn(4, 8, 1)
    candidates = {}

    def agree(tensor, op=None, group=None):  # MAX over the ranks' candidates seen so far
        candidates[group.r] = tensor.clone()
        return torch.stack(list(candidates.values())).amax(0)

    monkeypatch.setattr(collectives, "all_reduce", agree)
    monkeypatch.setattr(reward_trainer, "over_cp", lambda values: values)
    parts = {}
    for _ in range(2):  # the second pass: both ranks' candidates known
        for rank in range(2):
            as_rank(monkeypatch, rank)
            local = get_batch_on_this_cp_rank({"tokens": tokens, "labels": scores[..., 0]})
            parts[rank] = reward_trainer.scores_over_cp(local["labels"][..., None],
                                                        local["tokens"], pad)
    assert candidates[0].tolist() == [1, 1, 7, 0] and candidates[1].tolist() == [2, 4, 5, 0]
    whole = pooled(scores.float(), tokens, pad)[:, 0]
    assert torch.equal(parts[0] + parts[1], whole)
    assert torch.equal(parts[0] == 0, torch.tensor([True, True, False, False]))
