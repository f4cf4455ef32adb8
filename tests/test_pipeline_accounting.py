"""The embedding and the loss counted as pipeline layers (--account_for_embedding/loss_in_
pipeline_split), with and without the interleaved pipeline: our split of the layers into
stages and model chunks is megatron-core's own, layer for layer, accepted exactly where
megatron accepts it (chunks of no layer included); PP=2 x 2 virtual stages with both
counted gives the one-rank losses, resumes bit for bit and reshards to PP=1."""

import itertools

import pytest
import torch

from run_helpers import check_layout_resumes_and_reshards
from swift_mcore.arguments import RunArguments
from swift_mcore.errors import ArgumentError
from swift_mcore.run_config import resolve

SMALL = dict(hidden_size=64, num_attention_heads=4, micro_batch_size=1)


def resolved(num_layers, pp, **flags):
    return resolve(RunArguments.from_flags(**SMALL, num_layers=num_layers,
                                           pipeline_model_parallel_size=pp,
                                           global_batch_size=2 * pp, **flags),
                   world_size=pp, cuda=False)


def megatron_chunks(tc, pp, vp):
    """[stage][chunk] -> the layer numbers megatron-core builds there."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    chunks = []
    for rank in range(pp):
        stage = []
        for chunk in (range(vp) if vp else [None]):
            offset = get_transformer_layer_offset(tc, chunk, rank)
            stage.append(range(offset, offset + get_num_layers_to_build(tc, chunk, rank)))
        chunks.append(stage)
    return chunks


def megatron_refuses(num_layers, pp, vp, embedding, loss) -> bool:
    """Whether megatron-core's TransformerConfig or its layer split refuses the layout."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        tc = TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                               pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                               virtual_pipeline_model_parallel_size=vp,
                               account_for_embedding_in_pipeline_split=embedding,
                               account_for_loss_in_pipeline_split=loss)
        megatron_chunks(tc, pp, vp)
    except (ValueError, AssertionError):
        return True
    return False


GRID = list(itertools.product(range(1, 9), (2, 4), (None, 2, 3), (False, True), (False, True)))


def test_the_chunks_are_megatrons_and_refused_only_where_megatron_refuses():
    """Every (layers, PP, virtual stages, counted embedding, counted loss) of the grid: the
    layers of each chunk are those megatron-core builds from the run's TransformerConfig
    (empty chunks included: a counted embedding or loss can fill a whole chunk), and a
    layout is refused, naming the flag, exactly where megatron refuses it."""
    from swift_mcore.models.gpt import transformer_config

    accepted = counted_vpp = empty = 0
    for num_layers, pp, vp, embedding, loss in GRID:
        flags = dict(account_for_embedding_in_pipeline_split=embedding,
                     account_for_loss_in_pipeline_split=loss)
        if vp:
            flags["num_virtual_stages_per_pipeline_rank"] = vp
        refused = megatron_refuses(num_layers, pp, vp, embedding, loss)
        try:
            config = resolved(num_layers, pp, **flags)
        except ArgumentError as error:
            assert refused, (num_layers, pp, vp, embedding, loss, str(error))
            assert str(error).startswith("--"), str(error)
            continue
        assert not refused, (num_layers, pp, vp, embedding, loss)
        ours = config.args.pipeline_chunk_layers()
        theirs = megatron_chunks(transformer_config(config.complete(256, None)), pp, vp)
        assert ours == theirs, (num_layers, pp, vp, embedding, loss, ours, theirs)
        assert config.args.pipeline_stage_layers() == [sum(map(len, s)) for s in theirs]
        accepted += 1
        counted_vpp += bool(vp and (embedding or loss))
        empty += any(len(chunk) == 0 for stage in ours for chunk in stage)
    # the grid reaches the interesting layouts
    assert accepted > 30 and counted_vpp > 10 and empty > 10, (accepted, counted_vpp, empty)


def test_layers_per_virtual_stage_count_the_embedding_and_loss_as_megatron_lm_does():
    """--num_layers_per_virtual_pipeline_stage with the accounting: Megatron-LM's
    arguments.py counts the embedding and loss in each stage's share before dividing it
    into chunks (6 layers + 2 over PP=2: 4 places a stage, 2 per chunk: 2 chunks)."""
    both = dict(account_for_embedding_in_pipeline_split=True,
                account_for_loss_in_pipeline_split=True)
    by_size = resolved(6, 2, num_layers_per_virtual_pipeline_stage=2, **both).args
    by_count = resolved(6, 2, num_virtual_stages_per_pipeline_rank=2, **both).args
    assert by_size.virtual_stages() == 2
    assert by_size.pipeline_chunk_layers() == by_count.pipeline_chunk_layers() == [
        [range(0, 1), range(3, 5)], [range(1, 3), range(5, 6)]]


@pytest.mark.parametrize("layers,flags,message", [
    (5, dict(num_virtual_stages_per_pipeline_rank=2,
             account_for_embedding_in_pipeline_split=True),
     r"^--account_for_embedding_in_pipeline_split with --num_virtual_stages_per_pipeline_rank "
     r"2: each pipeline stage's 3 places \(--num_layers \(5\) plus the counted embedding, 6, "
     r"over --pipeline_model_parallel_size 2\) must split into 2 equal virtual stages$"),
    (5, dict(num_virtual_stages_per_pipeline_rank=2,
             account_for_embedding_in_pipeline_split=True,
             account_for_loss_in_pipeline_split=True),
     r"^--account_for_embedding_in_pipeline_split: --num_layers \(5\) plus the counted "
     r"embedding and loss \(7\) must split evenly over --pipeline_model_parallel_size \(2\)$"),
    (5, dict(num_layers_per_virtual_pipeline_stage=2,
             account_for_loss_in_pipeline_split=True),
     r"^--num_layers_per_virtual_pipeline_stage 2 with --account_for_loss_in_pipeline_split: "
     r"each pipeline stage's 3 places .* must split into chunks of 2$"),
    (4, dict(num_layers_per_virtual_pipeline_stage=0,
             account_for_loss_in_pipeline_split=True),
     r"^--num_layers_per_virtual_pipeline_stage must be a positive integer"),
])
def test_counted_layouts_megatron_refuses_are_refused(layers, flags, message):
    with pytest.raises(ArgumentError, match=message):
        resolved(layers, 2, **flags)


PP2 = ["--pipeline_model_parallel_size", "2"]
VPP = [*PP2, "--num_virtual_stages_per_pipeline_rank", "2"]
BOTH = ["--account_for_embedding_in_pipeline_split", "--account_for_loss_in_pipeline_split"]


@pytest.mark.benchmark
@pytest.mark.parametrize("layers,flags", [
    # megatron's chunks: rank 0 layer 0 and layers 3-4, rank 1 layers 1-2 and layer 5
    (6, [*VPP, *BOTH]),
    # rank 0: the embedding alone, then layer 1; rank 1: layer 0, then the loss alone
    (2, [*VPP, *BOTH]),
    # no interleaving: the first stage holds the embedding alone
    (1, [*PP2, "--account_for_embedding_in_pipeline_split"]),
])
def test_counted_stages_give_the_one_rank_losses_resume_and_reshard(tmp_path, layers, flags):
    """PP=2 with the embedding (and loss) counted, interleaved or not, empty chunks
    included: from a one-rank checkpoint it gives the one-rank losses, its own checkpoint
    resumes bit for bit, and that checkpoint continues at PP=1 with the straight run's
    losses."""
    check_layout_resumes_and_reshards(tmp_path, ["--num_layers", str(layers), "--train_iters",
                                                 "4"], flags)


def test_a_random_base_records_its_pipeline_split():
    """LoRA on a randomly initialised base: each stage draws its layers from its own seed in
    build order, so another split of the same layers (uneven stages, the embedding or loss
    counted) draws another frozen base. The base reference names the split, so resuming a
    LoRA checkpoint under another one is refused by base_model instead of training other
    weights; one split reached by other flags is the same draw, and the even split keeps
    the reference checkpoints already hold."""
    def reference(layers, **flags):
        return resolved(layers, 2, tuner_type="lora", **flags).base_model

    even = reference(4)
    assert even == "random initialization (--seed 42, PP 2)"
    first, last = (reference(4, decoder_first_pipeline_num_layers=1),
                   reference(4, decoder_last_pipeline_num_layers=1))
    assert len({even, first, last}) == 3
    assert first == "random initialization (--seed 42, PP 2, layers per stage 1/3)"
    assert (reference(3, account_for_embedding_in_pipeline_split=True)
            == reference(3, decoder_first_pipeline_num_layers=1)
            != reference(3, account_for_loss_in_pipeline_split=True))
