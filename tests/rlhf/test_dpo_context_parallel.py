"""rlhf dpo under context parallelism: each sequence's log-probabilities summed over the CP
ranks' chunks give the one-rank losses, metrics and gradient norms (the other tasks, and
CP with pipeline stages: test_task_context_parallel.py; packed rows:
test_packing_context_parallel.py): packed rows pass the argument checks with CP, under
pipeline stages for dpo."""

import json

import pytest

from cp_helpers import DPO_METRICS, assert_same_curves, one_rank_and_cp2
from rlhf_helpers import run_flags
from swift_mcore.arguments import RlhfArguments
from swift_mcore.errors import ArgumentError
from swift_mcore.run_config import resolve
from swift_mcore.training.rlhf_trainer import DpoTrainer


@pytest.mark.slow
def test_dpo_at_cp2_gives_the_one_rank_run(tiny_hf, tmp_path, gloo_group):
    """The frozen reference in the loop, the sft term on: every reduction over the pairs'
    log-probabilities (the sigmoid loss, the nll over the chosen tokens, the metrics)."""
    folder, data = tiny_hf
    flags = ["--rlhf_type", "dpo", "--model", str(folder), "--dataset", str(data),
             "--train_iters", "3", "--no_save", "--loss_type", "sigmoid", "sft",
             *run_flags("--micro_batch_size", "2")]
    one, cp, _ = one_rank_and_cp2(tmp_path, flags, DpoTrainer)
    for it in one:
        for name in DPO_METRICS:
            assert name in one[it], (it, name)
    assert_same_curves(one, cp, DPO_METRICS)


SMALL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
             micro_batch_size=1, global_batch_size=2, context_parallel_size=2)


def test_rlhf_packing_with_cp_is_accepted_and_under_stages_for_dpo_only(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    args = RlhfArguments.from_flags(**SMALL, rlhf_type="orpo", packing=True,
                                    dataset=[str(data)])
    assert resolve(args, world_size=2, cuda=False).world.context_parallel == 2
    args = RlhfArguments.from_flags(**SMALL, rlhf_type="dpo", packing=True,
                                    pipeline_model_parallel_size=2, dataset=[str(data)])
    assert resolve(args, world_size=4, cuda=False).world.pipeline_parallel == 2
    args = RlhfArguments.from_flags(**SMALL, rlhf_type="orpo", packing=True,
                                    pipeline_model_parallel_size=2, dataset=[str(data)])
    with pytest.raises(ArgumentError, match="--packing with --pipeline_model_parallel_size 2 "
                                            "packs DPO's pairs only yet") as err:
        resolve(args, world_size=4, cuda=False)
    assert "\n" not in str(err.value)
