"""Vision-language models under pipeline parallelism (the tower and its mergers on the first
stage; Qwen3-VL's deepstack layers there too): sft with images at PP=2 gives the one-rank
losses and gradient norms, resumes exactly (at PP=2 and at one rank), and its checkpoints
export transformers' tensors bit for bit."""

import pytest
import torch

import hf_helpers as H
from swift_mcore.errors import ArgumentError
from test_qwen2_5_vl import image_dataset, write_processor_files
from test_qwen3_vl import moe_folder, sft_two_ranks  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def vl3_three_layers(tmp_path_factory):
    """A Qwen3-VL folder with three decoder layers: its two deepstack layers fit a first
    stage of two, the third is the second stage's."""
    import test_qwen3_vl as T

    path = tmp_path_factory.mktemp("qwen3_vl_3") / "hf"
    text = T.TEXT
    T.TEXT = dict(text, num_hidden_layers=3)
    try:
        T.make_qwen3_vl(path)
    finally:
        T.TEXT = text
    write_processor_files(path)
    return path


def test_deepstack_layers_must_sit_on_the_first_stage(vl3_three_layers):
    """The tower is on the first stage: a split that puts a deepstack layer later is named
    with the flag that fixes it; a first stage of two layers is accepted; the interleaved
    schedule is refused in one line."""
    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve

    folder = str(vl3_three_layers)
    with pytest.raises(ArgumentError, match=r"the first pipeline stage holds 1 decoder "
                                            r"layer\(s\), but Qwen3-VL adds its 2 deepstack "
                                            r"features .* --decoder_first_pipeline_num_layers"):
        resolve(RunArguments.from_flags(model=folder, pipeline_model_parallel_size=2,
                                        decoder_last_pipeline_num_layers=2), world_size=2)
    resolve(RunArguments.from_flags(model=folder, pipeline_model_parallel_size=2,
                                    decoder_first_pipeline_num_layers=2), world_size=2)
    # the model is built as one chunk: the interleaved schedule is refused, not half-run
    with pytest.raises(ArgumentError, match=r"--num_virtual_stages_per_pipeline_rank \(the "
                                            r"interleaved pipeline schedule\) with a "
                                            r"vision-language model is not supported yet"):
        resolve(RunArguments.from_flags(model=folder, pipeline_model_parallel_size=3,
                                        num_virtual_stages_per_pipeline_rank=2), world_size=3)


def sft_ranks(out, ranks, *flags):
    """swift-mcore sft on ``ranks`` ranks (gloo) in a subprocess; fails the test on an
    error."""
    import subprocess
    import sys

    from run_helpers import ROOT, child_env, free_port
    from test_hf_training import run_flags

    env = child_env(NPROC_PER_NODE=str(ranks), MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "sft", *run_flags(),
                           "--output_dir", str(out), *map(str, flags)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_image_rows_pad_to_what_the_stages_and_chunks_exchange(tmp_path, vl3_three_layers):
    """Pipeline stages exchange one shape: image rows are --seq_length wide at PP=2;
    context parallelism cuts each row into 2 x CP chunks: widths are a multiple of 4 at
    CP=2; one rank pads to the longest row."""
    from swift_mcore.arguments.sft import SftArguments
    from swift_mcore.data.image_sft import build_image_sft_datasets
    from swift_mcore.data.tokenizer import load_tokenizer
    from swift_mcore.run_config import resolve

    data = image_dataset(tmp_path, rows=3)
    tokenizer = load_tokenizer(str(vl3_three_layers))

    def widths(world, **flags):
        args = resolve(SftArguments.from_flags(
            model=str(vl3_three_layers), dataset=[str(data)], seq_length=64,
            template="tokenizer", train_iters=1, **flags), world_size=world)
        train = build_image_sft_datasets(args, tokenizer, log=lambda line: None)[0]
        return {train.collate([train[i]])["tokens"].shape[1] for i in range(len(train))}

    one = widths(1)
    assert max(one) < 64 and any(w % 4 for w in one)
    assert widths(2, pipeline_model_parallel_size=2,
                  decoder_first_pipeline_num_layers=2) == {64}
    assert all(w % 4 == 0 and w - 4 < min(one) for w in widths(2, context_parallel_size=2))


def _steps(run):
    from run_helpers import train_records

    return {r["iteration"]: (r["loss"], r["grad_norm"]) for r in train_records(run)}


def _close(one, other, tolerance=1e-5):
    """Each step's loss and gradient norm within ``tolerance`` (relative to the value
    when it is above 1: the norms sum differently padded rows)."""
    return all(abs(a - b) <= tolerance * max(1.0, abs(a))
               for i in other for a, b in zip(one[i], other[i]))


@pytest.mark.benchmark
def test_pp2_sft_with_images_equals_one_rank(tmp_path, train_here, vl3_three_layers):
    """sft with images at PP=2 (the tower, mergers and deepstack layers on the first stage,
    training; packed rows; every layer recomputed, the deepstack features added again to
    each micro-batch's recomputed layers): the one-rank losses and gradient norms within
    1e-5; resumed at PP=2 bit for bit, and at one rank from the PP=2 checkpoint; the PP=2
    checkpoint exports the folder's tensor names, which transformers loads."""
    from test_hf_training import run_flags

    data = image_dataset(tmp_path, rows=16)
    flags = ["--model", vl3_three_layers, "--dataset", data, "--seq_length", "64", "--lr",
             "1e-2", "--min_lr", "1e-2", "--train_iters", "3", "--template", "tokenizer",
             "--freeze_vit", "false", "--freeze_aligner", "false", "--packing", "true",
             "--recompute_granularity", "full", "--recompute_method", "uniform",
             "--recompute_num_layers", "1"]
    pp2 = ["--pipeline_model_parallel_size", "2", "--decoder_first_pipeline_num_layers", "2"]
    train_here(tmp_path / "one", *flags, "--no_save", base=run_flags())
    sft_two_ranks(tmp_path / "pp2", *flags, *pp2, "--save_steps", "2")
    checkpoint = tmp_path / "pp2" / "checkpoint" / "iter_0000002"
    sft_two_ranks(tmp_path / "resumed", *flags, *pp2, "--no_save", "--resume", checkpoint)
    train_here(tmp_path / "at_one", *flags, "--no_save", "--resume", checkpoint,
               base=run_flags())
    one, pp, resumed, at_one = (_steps(tmp_path / name)
                                for name in ("one", "pp2", "resumed", "at_one"))
    assert sorted(one) == sorted(pp) == [1, 2, 3] and sorted(resumed) == sorted(at_one) == [3]
    assert one[3][0] < one[1][0]
    assert _close(one, pp) and _close(one, at_one), (one, pp, at_one)
    assert resumed[3] == pp[3]
    H.convert(checkpoint, tmp_path / "exported", "to_hf")
    original = H.safetensors_state(str(vl3_three_layers))
    exported = H.safetensors_state(str(tmp_path / "exported"))
    assert sorted(exported) == sorted(original)
    assert any(not torch.equal(exported[n], t) for n, t in original.items()
               if n.startswith("model.visual.blocks."))  # the tower trained


@pytest.mark.benchmark
def test_pp2_checkpoint_matches_transformers_and_exports_bit_identical(
        tmp_path, gloo_group, vl3_three_layers):
    """The folder loaded at PP=2 (the tower on the first stage): text logits are
    transformers', and its checkpoint exports every tensor bit for bit, as one rank's."""
    from test_hf_parallel import run_two_ranks
    from test_qwen3_vl import transformers_model

    ids, out = run_two_ranks(tmp_path, vl3_three_layers, 1, 2, "--first_stage_layers", "2")
    with torch.no_grad():
        theirs = transformers_model(vl3_three_layers)(input_ids=ids).logits
    assert (torch.load(out / "logits.pt") - theirs).abs().max() <= 1e-4
    H.convert(out, tmp_path / "exported", "to_hf")
    original = H.safetensors_state(str(vl3_three_layers))
    back = H.safetensors_state(str(tmp_path / "exported"))
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[name], tensor) for name, tensor in original.items())


@pytest.mark.benchmark
def test_cp2_sft_with_images_equals_one_rank(tmp_path, train_here, vl3_three_layers):
    """sft with images at CP=2 (the tower whole on each rank over every image of the row;
    the embeddings, deepstack features and 3-row positions split into megatron's 2 x CP
    chunks; packed rows; the tower and mergers training): the one-rank losses and gradient
    norms within 1e-5."""
    from test_hf_training import run_flags

    data = image_dataset(tmp_path, rows=16)
    flags = ["--model", vl3_three_layers, "--dataset", data, "--seq_length", "64", "--lr",
             "1e-2", "--min_lr", "1e-2", "--train_iters", "3", "--template", "tokenizer",
             "--freeze_vit", "false", "--freeze_aligner", "false", "--packing", "true",
             "--no_save"]
    train_here(tmp_path / "one", *flags, base=run_flags())
    sft_two_ranks(tmp_path / "cp2", *flags, "--context_parallel_size", "2")
    one, cp = _steps(tmp_path / "one"), _steps(tmp_path / "cp2")
    assert sorted(one) == sorted(cp) == [1, 2, 3] and one[3][0] < one[1][0]
    assert _close(one, cp), (one, cp)


@pytest.mark.benchmark
def test_cp2_with_tp2_or_pp2_on_four_ranks_equals_one_rank(tmp_path, train_here,
                                                            vl3_three_layers):
    """CP=2 with TP=2 and --sequence_parallel (the embeddings split into CP chunks, then
    over the TP ranks), and CP=2 with PP=2 (every layer recomputed): the one-rank losses
    and gradient norms within 1e-5."""
    from test_hf_training import run_flags

    data = image_dataset(tmp_path, rows=16)
    flags = ["--model", vl3_three_layers, "--dataset", data, "--seq_length", "64", "--lr",
             "1e-2", "--min_lr", "1e-2", "--train_iters", "3", "--template", "tokenizer",
             "--freeze_vit", "false", "--freeze_aligner", "false", "--packing", "true",
             "--recompute_granularity", "full", "--recompute_method", "uniform",
             "--recompute_num_layers", "1", "--no_save", "--context_parallel_size", "2"]
    train_here(tmp_path / "one", *flags[:-2], base=run_flags())
    sft_ranks(tmp_path / "cp_sp", 4, *flags, "--tensor_model_parallel_size", "2",
              "--sequence_parallel")
    sft_ranks(tmp_path / "cp_pp", 4, *flags, "--pipeline_model_parallel_size", "2",
              "--decoder_first_pipeline_num_layers", "2")
    one = _steps(tmp_path / "one")
    for run in ("cp_sp", "cp_pp"):
        other = _steps(tmp_path / run)
        assert sorted(other) == [1, 2, 3] and _close(one, other), (run, one, other)


@pytest.mark.benchmark
def test_moe_tp2_sequence_parallel_equals_one_rank(tmp_path, train_here, moe_folder):
    """Qwen3-VL-MoE at TP=2 with --sequence_parallel (megatron's MoE layer needs it at
    TP > 1): the tower and mergers training, packed rows, each rank adding its part of the
    deepstack features; the one-rank losses and gradient norms within 1e-5. The router's
    load-balancing loss is off: it counts the padding tokens, and --sequence_parallel pads
    each row to a multiple of TP where one rank pads to the longest row."""
    from test_hf_training import run_flags

    data = image_dataset(tmp_path, rows=16)
    flags = ["--model", moe_folder[1], "--dataset", data, "--seq_length", "64", "--lr",
             "1e-2", "--min_lr", "1e-2", "--train_iters", "3", "--template", "tokenizer",
             "--freeze_vit", "false", "--freeze_aligner", "false", "--packing", "true",
             "--moe_aux_loss_coeff", "0", "--no_save"]
    train_here(tmp_path / "one", *flags, base=run_flags())
    sft_two_ranks(tmp_path / "sp", *flags, "--tensor_model_parallel_size", "2",
                  "--sequence_parallel")
    one, sp = _steps(tmp_path / "one"), _steps(tmp_path / "sp")
    assert sorted(one) == sorted(sp) == [1, 2, 3] and one[3][0] < one[1][0]
    assert _close(one, sp), (one, sp)


def test_recomputed_layers_take_their_own_micro_batchs_deepstack(gloo_group, vl3_three_layers):
    """Pipeline schedules run the forward of the next micro-batch before the backward of
    this one; with every layer recomputed, each micro-batch's recomputed deepstack layers
    still add its own features: the gradients of forward A, forward B, backward A,
    backward B are those of A then B."""
    from swift_mcore.loaded_model import load_model

    model = load_model(str(vl3_three_layers), log=lambda line: None).model.train()
    model.requires_grad_(True)
    c = model.config
    c.recompute_granularity, c.recompute_method, c.recompute_num_layers = "full", "uniform", 1
    from test_qwen2_5_vl import image_prompt

    batches = [image_prompt([(1, 4, 8)], seed=1), image_prompt([(1, 6, 2), (1, 2, 2)], seed=2)]

    def loss(ids, pixels, grids):
        logits = model(input_ids=ids, position_ids=None, attention_mask=None,
                       pixel_values=pixels, image_grid_thw=grids)
        weights = torch.randn(logits.shape[1:], generator=torch.Generator().manual_seed(0))
        return (logits[0] * weights).sum()

    def gradients(interleaved):
        model.zero_grad(set_to_none=True)
        if interleaved:
            first, second = (loss(*b) for b in batches)
            first.backward()
            second.backward()
        else:
            for b in batches:
                loss(*b).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    in_order, interleaved = gradients(False), gradients(True)
    assert in_order["visual.deepstack_merger_list.1.linear_fc2.weight"].abs().max() > 0
    assert all(torch.allclose(interleaved[n], g, rtol=0, atol=1e-6)
               for n, g in in_order.items())
