"""Qwen3-VL (models/vision.py, family qwen3_vl): a tiny random folder built from transformers'
config gives transformers' logits on an image prompt (deepstack features, interleaved
multimodal RoPE, Qwen3's q/k norms) and on text alone, goes HF -> checkpoint -> HF bit for
bit, and trains on image rows with an exact resume."""

import json
import shutil

import pytest
import torch

import hf_helpers as H
from test_qwen2_5_vl import (IMAGE, VIDEO, START, END, image_dataset, image_prompt,
                             write_processor_files)

TEXT = dict(H.BASE, head_dim=16, rope_parameters={
    "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
    "mrope_interleaved": True}, bos_token_id=None, eos_token_id=0)
# patches of 4x4 pixels, 2x2 merged; a 4x4 learned position grid (interpolated per image);
# the first two of three blocks feed the first two decoder layers (deepstack)
VISION = dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
              patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
              num_position_embeddings=16, deepstack_visual_indexes=[0, 1], in_channels=3,
              initializer_range=0.2)


def make_qwen3_vl(path, seed: int = 0):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE,
                           video_token_id=VIDEO, vision_start_token_id=START,
                           vision_end_token_id=END, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration._from_config(
        config, attn_implementation="eager").float()
    model.save_pretrained(str(path))


@pytest.fixture(scope="module")
def vl3_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_vl") / "hf"
    make_qwen3_vl(path)
    write_processor_files(path)
    return path


def transformers_model(folder):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager").eval()


def test_logits_match_transformers_with_images_and_without(gloo_group, vl3_folder):
    from swift_mcore.loaded_model import load_model

    loaded = load_model(str(vl3_folder), log=lambda line: None)
    m = loaded.config.model
    assert (m.model_type, m.position_embedding_type, m.mrope_section, m.qk_layernorm) == (
        "qwen3_vl", "mrope", "[2,3,3]", True)
    model, hf = loaded.model.eval(), transformers_model(vl3_folder)
    ids, pixels, grids = image_prompt([(1, 4, 8), (1, 6, 2)])

    def ours(**inputs):
        with torch.no_grad():
            return model(position_ids=None, attention_mask=None, **inputs)[..., :320]

    with torch.no_grad():
        theirs = hf(input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
                    mm_token_type_ids=(ids == IMAGE).int()).logits
    assert (ours(input_ids=ids, pixel_values=pixels, image_grid_thw=grids) - theirs
            ).abs().max() <= 1e-4
    # the deepstack features count: without them the logits are others
    mergers = model.visual.deepstack_merger_list
    saved = [p.detach().clone() for p in mergers.parameters()]
    with torch.no_grad():
        for p in mergers.parameters():
            p.zero_()
    assert (ours(input_ids=ids, pixel_values=pixels, image_grid_thw=grids) - theirs
            ).abs().max() > 1e-2
    with torch.no_grad():
        for p, value in zip(mergers.parameters(), saved):
            p.copy_(value)
    text = H.tokens(vocab=290, batch=2, length=24)
    with torch.no_grad():
        theirs = hf(input_ids=text).logits
    assert (ours(input_ids=text) - theirs).abs().max() <= 1e-4


def test_interleaved_rope_is_transformers_layout(gloo_group, vl3_folder):
    """Each channel pair takes the row transformers' Qwen3-VL gives it (its cos equal)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from swift_mcore.loaded_model import load_model

    loaded = load_model(str(vl3_folder), log=lambda line: None)
    rope = loaded.model.rotary_pos_emb
    positions = torch.stack([torch.arange(10), torch.arange(10) * 3,
                             torch.arange(10) * 7])[:, None, :]
    ours = rope(positions, [2, 3, 3])[:, 0, 0]  # [sequence, head_dim] angles
    theirs, _ = Qwen3VLTextRotaryEmbedding(transformers_model(vl3_folder).config.text_config)(
        torch.zeros(1, dtype=torch.float32), positions)
    assert (ours.cos() - theirs[0]).abs().max() <= 1e-6
    # not Qwen2.5-VL's contiguous blocks: the third pair takes the width row here
    assert torch.equal(ours[:, 2], positions[2, 0].float() * rope.inv_freq[2])


def test_folder_exports_bit_for_bit_with_transformers_names(gloo_group, vl3_folder, tmp_path):
    """HF -> checkpoint (its --test_convert_precision feeds an image) -> HF: every tensor
    under the folder's own names (model.language_model.*, model.visual.*), a config.json
    transformers loads to the same logits."""
    config = H.check_round_trip(vl3_folder, tmp_path)
    source = json.loads((vl3_folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert config["vision_config"] == source["vision_config"]
    assert config["text_config"]["rope_parameters"] == source["text_config"]["rope_parameters"]
    for key in ("image_token_id", "video_token_id", "vision_start_token_id",
                "vision_end_token_id", "tie_word_embeddings"):
        assert config[key] == source[key], key
    names = H.safetensors_state(str(tmp_path / "back"))
    assert any(n.startswith("model.language_model.layers.") for n in names)
    assert any(n.startswith("model.visual.deepstack_merger_list.") for n in names)
    ids, pixels, grids = image_prompt([(1, 4, 4)])
    with torch.no_grad():
        logits = [transformers_model(f)(input_ids=ids, pixel_values=pixels,
                                        image_grid_thw=grids,
                                        mm_token_type_ids=(ids == IMAGE).int()).logits
                  for f in (vl3_folder, tmp_path / "back")]
    assert torch.equal(*logits)


def test_sft_with_images_trains_and_resumes_exactly(tmp_path, train_here, vl3_folder):
    """Full sft on image rows (the tower and mergers frozen by default, as ms-swift): the
    loss falls, a resume from step 2 logs steps 3 and 4 exactly, and the deepstack mergers
    are trained when --freeze_aligner false asks."""
    from run_helpers import losses
    from test_hf_training import run_flags

    from swift_mcore.models.vision import part_of

    data = image_dataset(tmp_path)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    flags = ["--model", vl3_folder, "--dataset", data, "--seq_length", "64", "--lr", "1e-2",
             "--min_lr", "1e-2", "--train_iters", "4", "--template", "tokenizer"]
    train_here(straight, *flags, "--save_steps", "2", base=run_flags())
    train_here(resumed, *flags, "--no_save", "--resume",
               straight / "checkpoint" / "iter_0000002", base=run_flags())
    first, second = losses(straight), losses(resumed)
    assert sorted(first) == [1, 2, 3, 4] and sorted(second) == [3, 4]
    assert second == {3: first[3], 4: first[4]}
    assert first[4] < first[1]
    assert part_of("visual.deepstack_merger_list.0.norm.weight") == "aligner"


# ---- Qwen3-VL-MoE (family qwen3_vl_moe) ----------------------------------------------------

MOE_TEXT = dict(TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                decoder_sparse_step=1, mlp_only_layers=[1])  # layer 0 MoE, layer 1 dense


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    path = tmp_path_factory.mktemp("qwen3_vl_moe") / "hf"
    config = Qwen3VLMoeConfig(text_config=MOE_TEXT, vision_config=VISION,
                              image_token_id=IMAGE, video_token_id=VIDEO,
                              vision_start_token_id=START, vision_end_token_id=END,
                              tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3VLMoeForConditionalGeneration._from_config(
        config, attn_implementation="eager").float()
    with torch.no_grad():  # a router that tells the experts apart (its init is zeros)
        for layer in model.model.language_model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 0.5)
    model.save_pretrained(str(path))
    write_processor_files(path)
    # the Hub's layout of the stacked experts ([experts, hidden, 2 * ffn], [experts, ffn,
    # hidden]); transformers writes them as it holds them in memory, and reads both
    hub = path.parent / "hub"
    shutil.copytree(path, hub)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(hub / "model.safetensors"))
    for name in list(tensors):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, str(hub / "model.safetensors"), metadata={"format": "pt"})
    return path, hub


def test_moe_logits_match_transformers_and_export_bit_for_bit(gloo_group, moe_folder,
                                                               tmp_path):
    """The experts' stacked tensors (gate_up_proj [experts, hidden, 2 * ffn], down_proj)
    split into megatron's experts and back bit for bit; the logits on an image prompt are
    transformers' Qwen3VLMoeForConditionalGeneration's."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    from swift_mcore.loaded_model import load_model

    saved, hub = moe_folder
    ids, pixels, grids = image_prompt([(1, 4, 8), (1, 6, 2)])
    hf = Qwen3VLMoeForConditionalGeneration.from_pretrained(
        str(saved), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = hf(input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
                    mm_token_type_ids=(ids == IMAGE).int()).logits
    for folder in (saved, hub):  # either layout of the experts
        loaded = load_model(str(folder), log=lambda line: None)
        m = loaded.config.model
        assert (m.model_type, m.num_experts, m.moe_layer_freq) == ("qwen3_vl_moe", 4, "[1,0]")
        with torch.no_grad():
            ours = loaded.model.eval()(input_ids=ids, position_ids=None, attention_mask=None,
                                       pixel_values=pixels, image_grid_thw=grids)[..., :320]
        assert (ours - theirs).abs().max() <= 1e-4, folder
    config = H.check_round_trip(hub, tmp_path)
    assert config["architectures"] == ["Qwen3VLMoeForConditionalGeneration"]
    assert config["text_config"]["model_type"] == "qwen3_vl_moe_text"
    names = H.safetensors_state(str(tmp_path / "back"))
    assert tuple(names["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape) == (
        4, 64, 48)
    with torch.no_grad():
        again = Qwen3VLMoeForConditionalGeneration.from_pretrained(
            str(tmp_path / "back"), dtype=torch.float32, attn_implementation="eager").eval()(
            input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
            mm_token_type_ids=(ids == IMAGE).int()).logits
    assert torch.equal(again, theirs)


def test_moe_sft_with_images_trains(tmp_path, train_here, moe_folder):
    from run_helpers import losses
    from test_hf_training import run_flags

    data = image_dataset(tmp_path, rows=8)
    train_here(tmp_path / "out", "--model", moe_folder[1], "--dataset", data, "--seq_length",
               "64", "--lr", "1e-2", "--min_lr", "1e-2", "--train_iters", "3", "--template",
               "tokenizer", "--no_save", base=run_flags())
    first = losses(tmp_path / "out")
    assert sorted(first) == [1, 2, 3] and first[3] < first[1]


def test_packed_image_rows_give_each_samples_logits(gloo_group, vl3_folder):
    """Two image prompts in one row under the block-causal mask, positions restarting at
    the second: each gets its logits alone (the deepstack features land on each sample's
    own image pads)."""
    from swift_mcore.data.packing import block_causal_mask
    from swift_mcore.loaded_model import load_model

    model = load_model(str(vl3_folder), log=lambda line: None).model.eval()
    first, pixels1, grids1 = image_prompt([(1, 4, 8)], seed=1)
    second, pixels2, grids2 = image_prompt([(1, 6, 2), (1, 2, 2)], seed=2)
    n1, n2 = first.shape[1], second.shape[1]
    positions = torch.cat([torch.arange(n1), torch.arange(n2)])[None]
    with torch.no_grad():
        packed = model(input_ids=torch.cat([first, second], dim=1), position_ids=positions,
                       attention_mask=block_causal_mask(torch.tensor([[0] * n1 + [1] * n2])),
                       pixel_values=torch.cat([pixels1, pixels2]),
                       image_grid_thw=torch.cat([grids1, grids2]))
        alone = [model(input_ids=ids, position_ids=None, attention_mask=None,
                       pixel_values=p, image_grid_thw=g)
                 for ids, p, g in ((first, pixels1, grids1), (second, pixels2, grids2))]
    assert (packed[:, :n1] - alone[0]).abs().max() <= 1e-5
    assert (packed[:, n1:] - alone[1]).abs().max() <= 1e-5


def test_full_recompute_trains_the_tower_with_the_deepstack_features(gloo_group, vl3_folder):
    """Every layer recomputed in the backward (--recompute_granularity full) with the whole
    tower training: each parameter's gradient is the one without recompute (the deepstack
    features' gradients reach the tower blocks in the one backward pass)."""
    from swift_mcore.loaded_model import load_model

    model = load_model(str(vl3_folder), log=lambda line: None).model.train()
    model.requires_grad_(True)
    ids, pixels, grids = image_prompt([(1, 4, 8), (1, 6, 2)])
    weights = torch.randn(ids.shape[1], 320, generator=torch.Generator().manual_seed(0))

    def gradients(recompute):
        c = model.config
        c.recompute_granularity, c.recompute_method, c.recompute_num_layers = (
            ("full", "uniform", 1) if recompute else (None, None, None))
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, position_ids=None, attention_mask=None,
                       pixel_values=pixels, image_grid_thw=grids)
        (logits[0] * weights).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, recomputed = gradients(False), gradients(True)
    assert plain["visual.blocks.0.mlp.linear_fc1.weight"].abs().max() > 0
    assert sorted(recomputed) == sorted(plain)
    assert all(torch.allclose(recomputed[n], g, rtol=0, atol=1e-6) for n, g in plain.items())


@pytest.mark.benchmark
def test_full_recompute_keeps_the_deepstack_features(tmp_path, train_here, vl3_folder):
    """--recompute_granularity full recomputes each layer in the backward: the deepstack
    features are added there too (a hook on the layer), so the losses, mergers trained,
    are those without recompute."""
    from run_helpers import losses
    from test_hf_training import run_flags

    data = image_dataset(tmp_path, rows=8)
    flags = ["--model", vl3_folder, "--dataset", data, "--seq_length", "64", "--lr", "1e-2",
             "--min_lr", "1e-2", "--train_iters", "3", "--template", "tokenizer", "--no_save",
             "--freeze_aligner", "false"]
    train_here(tmp_path / "plain", *flags, base=run_flags())
    train_here(tmp_path / "recomputed", *flags, "--recompute_granularity", "full",
               "--recompute_method", "uniform", "--recompute_num_layers", "1",
               base=run_flags())
    assert losses(tmp_path / "recomputed") == losses(tmp_path / "plain")


def sft_two_ranks(out, *flags):
    """swift-mcore sft on two ranks (gloo) in a subprocess; fails the test on an error."""
    import subprocess
    import sys

    from run_helpers import ROOT, child_env, free_port
    from test_hf_training import run_flags

    env = child_env(NPROC_PER_NODE="2", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "sft", *run_flags(),
                           "--output_dir", str(out), *map(str, flags)],
                          capture_output=True, text=True, timeout=400, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.benchmark
def test_tp2_sft_with_images_equals_one_rank(tmp_path, train_here, vl3_folder):
    """sft with images at TP=2 (the tower whole on each rank, training with the mergers;
    packed rows; every layer recomputed), also with --sequence_parallel (the image and
    deepstack features split along the sequence): the one-rank losses and gradient norms
    within 1e-5; resumed at TP=2 from the one-rank checkpoint (the tower's Adam state on
    both ranks), the one-rank step 3."""
    from run_helpers import train_records
    from test_hf_training import run_flags

    data = image_dataset(tmp_path, rows=16)
    flags = ["--model", vl3_folder, "--dataset", data, "--seq_length", "64", "--lr", "1e-2",
             "--min_lr", "1e-2", "--train_iters", "3", "--template", "tokenizer",
             "--freeze_vit", "false", "--freeze_aligner", "false", "--packing", "true",
             "--recompute_granularity", "full"]
    tp2 = ["--tensor_model_parallel_size", "2"]
    train_here(tmp_path / "one", *flags, "--save_steps", "2", base=run_flags())
    sft_two_ranks(tmp_path / "tp2", *flags, *tp2, "--no_save")
    sft_two_ranks(tmp_path / "sp", *flags, *tp2, "--sequence_parallel", "--no_save")
    sft_two_ranks(tmp_path / "resumed", *flags, *tp2, "--no_save", "--resume",
                  tmp_path / "one" / "checkpoint" / "iter_0000002")

    def steps(run):
        return {r["iteration"]: (r["loss"], r["grad_norm"]) for r in train_records(run)}

    one, two, sp, resumed = (steps(tmp_path / name)
                             for name in ("one", "tp2", "sp", "resumed"))
    assert sorted(one) == sorted(two) == sorted(sp) == [1, 2, 3] and sorted(resumed) == [3]
    assert one[3][0] < one[1][0]
    for other in (two, sp, resumed):
        assert all(abs(a - b) <= 1e-5 for i in other for a, b in zip(one[i], other[i])), \
            (one, other)


@pytest.mark.benchmark
def test_tp2_matches_transformers_and_exports_bit_identical(tmp_path, gloo_group, vl3_folder):
    """TP=2 on gloo: the language model sharded, the tower whole on each rank; the logits
    of text are transformers', and the TP=2 checkpoint exports every tensor bit for bit
    under the nested names."""
    from test_hf_parallel import run_two_ranks

    ids, out = run_two_ranks(tmp_path, vl3_folder, 2, 1)
    with torch.no_grad():
        theirs = transformers_model(vl3_folder)(input_ids=ids).logits
    assert (torch.load(out / "logits.pt") - theirs).abs().max() <= 1e-4
    H.convert(out, tmp_path / "exported", "to_hf")
    H.assert_same_weights(vl3_folder, tmp_path / "exported")


def test_infer_with_an_image_gives_transformers_greedy_tokens(gloo_group, vl3_folder, tmp_path):
    from swift_mcore.arguments.infer import InferArguments
    from swift_mcore.infer import run
    from test_qwen2_5_vl import transformers_greedy_answer, write_image

    image = write_image(tmp_path / "cat.png", 20, 12)
    answer = run(InferArguments(model=str(vl3_folder), prompt="what is it?", image=image,
                                template="tokenizer", max_new_tokens=5).validate())
    expected = transformers_greedy_answer(transformers_model(vl3_folder), vl3_folder, image,
                                          "what is it?", 5)
    assert answer and answer == expected, (answer, expected)
