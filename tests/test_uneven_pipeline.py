"""Uneven pipeline stages (--decoder_first/last_pipeline_num_layers, the embedding and the
loss counted as layers): the split megatron builds, checked before any work; PP=2 with a
1-layer first stage gives the one-rank losses from the same weights (a one-rank checkpoint
resharded by dist_checkpointing)."""

import pytest

from run_helpers import losses, run_pt
from swift_mcore.arguments import RunArguments
from swift_mcore.errors import ArgumentError
from swift_mcore.run_config import resolve

SMALL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, micro_batch_size=1,
             global_batch_size=4)


def stages(world=2, **flags):
    return resolve(RunArguments.from_flags(**{**SMALL, **flags}), world_size=world,
                   cuda=False).args.pipeline_stage_layers()


def test_the_split_of_each_flag():
    assert stages(pipeline_model_parallel_size=2) == [2, 2]
    assert stages(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=1) == [1, 3]
    assert stages(pipeline_model_parallel_size=2, decoder_last_pipeline_num_layers=3) == [1, 3]
    assert stages(4, num_layers=6, pipeline_model_parallel_size=4,
                  decoder_first_pipeline_num_layers=1,
                  decoder_last_pipeline_num_layers=1) == [1, 2, 2, 1]
    assert stages(num_layers=5, pipeline_model_parallel_size=2,
                  account_for_embedding_in_pipeline_split=True) == [2, 3]
    assert stages(num_layers=4, pipeline_model_parallel_size=2,
                  account_for_embedding_in_pipeline_split=True,
                  account_for_loss_in_pipeline_split=True) == [2, 2]


@pytest.mark.parametrize("flags", [
    dict(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=1),
    dict(num_layers=6, pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=1,
         decoder_last_pipeline_num_layers=1),
    dict(num_layers=5, pipeline_model_parallel_size=2,
         account_for_embedding_in_pipeline_split=True),
])
def test_megatron_builds_the_split_the_flags_say(flags):
    """The TransformerConfig the run builds gives megatron's stages these layers."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    from swift_mcore.models.gpt import transformer_config

    config = resolve(RunArguments.from_flags(**{**SMALL, **flags}),
                     world_size=flags["pipeline_model_parallel_size"],
                     cuda=False).complete(256, None)
    tc = transformer_config(config)
    built = [get_num_layers_to_build(tc, pp_rank=rank)
             for rank in range(flags["pipeline_model_parallel_size"])]
    assert built == config.args.pipeline_stage_layers()
    assert built != [config.model.num_layers // len(built)] * len(built)


def test_megatron_builds_the_uneven_interleaved_split():
    """PP=2 x 2 virtual stages, 6 layers, 4 on the first stage: megatron's chunks hold
    layers 0-1 and 3-4 on rank 0, 2 and 5 on rank 1 (each model chunk in pipeline order)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from swift_mcore.models.gpt import transformer_config

    config = resolve(RunArguments.from_flags(**{**SMALL, "num_layers": 6},
                                             pipeline_model_parallel_size=2,
                                             num_virtual_stages_per_pipeline_rank=2,
                                             decoder_first_pipeline_num_layers=4),
                     world_size=2, cuda=False)
    assert config.args.pipeline_stage_layers() == [4, 2]
    tc = transformer_config(config.complete(256, None))
    layers = {(rank, vp): list(range(get_transformer_layer_offset(tc, vp, rank),
                                     get_transformer_layer_offset(tc, vp, rank)
                                     + get_num_layers_to_build(tc, vp_stage=vp, pp_rank=rank)))
              for rank in range(2) for vp in range(2)}
    assert layers == {(0, 0): [0, 1], (1, 0): [2], (0, 1): [3, 4], (1, 1): [5]}


@pytest.mark.parametrize("flags,message", [
    ({"decoder_first_pipeline_num_layers": 1}, "needs --pipeline_model_parallel_size > 1"),
    ({"pipeline_model_parallel_size": 2, "decoder_first_pipeline_num_layers": 4},
     "the other 1 pipeline stage\\(s\\) must split the remaining 0"),
    ({"pipeline_model_parallel_size": 2, "decoder_first_pipeline_num_layers": 1,
      "decoder_last_pipeline_num_layers": 1}, "must split the remaining 2"),
    ({"pipeline_model_parallel_size": 2, "decoder_first_pipeline_num_layers": 0},
     "--decoder_first_pipeline_num_layers must be at least 1"),
    ({"pipeline_model_parallel_size": 2, "decoder_first_pipeline_num_layers": 1,
      "account_for_loss_in_pipeline_split": True}, "both decide the split"),
    ({"pipeline_model_parallel_size": 2, "account_for_loss_in_pipeline_split": True},
     "plus the counted loss \\(5\\) must split evenly"),
    ({"pipeline_model_parallel_size": 2, "num_virtual_stages_per_pipeline_rank": 2,
      "decoder_first_pipeline_num_layers": 1},
     "each pipeline stage's layers \\(1, 3\\) must split into 2 equal virtual stages"),
    ({"pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 1,
      "decoder_first_pipeline_num_layers": 2},
     "Megatron-LM refuses it too\\); give --num_virtual_stages_per_pipeline_rank instead"),
])
def test_uneven_flags_are_checked(flags, message):
    world = flags.get("pipeline_model_parallel_size", 1)
    with pytest.raises(ArgumentError, match=message):
        resolve(RunArguments.from_flags(**{**SMALL, **flags}), world_size=world, cuda=False)


@pytest.mark.slow
def test_uneven_first_stage_gives_the_one_rank_losses(tmp_path):
    one, uneven = tmp_path / "one", tmp_path / "uneven"
    shape = ["--num_layers", "4", "--train_iters", "3"]
    run_pt(one, *shape, "--save_steps", "1")
    run_pt(uneven, *shape, "--no_save", "--pipeline_model_parallel_size", "2",
           "--decoder_first_pipeline_num_layers", "1",
           "--resume", one / "checkpoint" / "iter_0000001", nproc=2, timeout=600)
    ref, got = losses(one), losses(uneven)
    assert sorted(got) == [2, 3]
    for it in got:
        assert abs(got[it] - ref[it]) <= 1e-5, (it, got[it], ref[it])
