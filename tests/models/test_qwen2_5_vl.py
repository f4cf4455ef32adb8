"""Qwen2.5-VL (models/vision.py): a tiny random folder built from transformers' config gives
transformers' logits on an image prompt and on text alone, its 3-D positions are
transformers' get_rope_index's, and its weights go HF -> model -> HF bit for bit."""

import json

import pytest
import torch

import hf_helpers as H

IMAGE, VIDEO, START, END = 300, 301, 302, 303
TEXT = dict(H.BASE, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                     "mrope_section": [2, 3, 3]},
            bos_token_id=None, eos_token_id=0)
# patches of 4x4 pixels, 2x2 merged; windows of 2x2 merged patches, the second block global
VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
              patch_size=4, spatial_merge_size=2, temporal_patch_size=2, window_size=16,
              fullatt_block_indexes=[1], in_channels=3, initializer_range=0.2)


def make_qwen2_5_vl(path, seed: int = 0):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE,
                              video_token_id=VIDEO, vision_start_token_id=START,
                              vision_end_token_id=END, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration._from_config(
        config, attn_implementation="eager").float()
    model.save_pretrained(str(path))
    return model.eval()


def image_prompt(grids, text=(5, 3, 4), seed=0):
    """input_ids [1, n] of text runs around <start> pads <end> per image, and the images'
    patches [patches, 3 * 2 * 4 * 4] (random pixels after the processor's flattening)."""
    generator = torch.Generator().manual_seed(seed)
    ids: list = []
    for i, (t, h, w) in enumerate(grids):
        ids += torch.randint(0, 290, (text[i % len(text)],), generator=generator).tolist()
        ids += [START] + [IMAGE] * (t * h * w // 4) + [END]
    ids += torch.randint(0, 290, (text[-1],), generator=generator).tolist()
    patches = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(patches, 3 * 2 * 4 * 4, generator=generator)
    return torch.tensor([ids]), pixels, torch.tensor(grids)


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl") / "hf"
    make_qwen2_5_vl(path)
    return path


def load_ours(folder):
    """Our model for ``folder``, its weights read from the files; and its layout."""
    from swift_mcore.arguments import RunArguments
    from swift_mcore.models import vision
    from swift_mcore.models.convert import Layout
    from swift_mcore.models.hf_folder import HFFolder
    from swift_mcore.run_config import resolve

    hf = HFFolder(str(folder))
    vl = vision.VisionLanguage.from_hf_config(hf.config)
    values = vision.language_values(hf.config)
    flags = RunArguments.from_flags(**values, precision="fp32",
                                    seq_length=128)
    config = resolve(flags, world_size=1, weights_only=True).complete(values["vocab_size"],
                                                                      None)
    model = vision.build_vl_model(config, vl, initialize=False)
    layout = Layout.from_model_args(config.model, config.padded_vocab_size)
    with hf.reader() as reader, torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(vision.to_mcore(layout, name, reader.read))
    return model.eval(), layout, vl


def transformers_model(folder):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager").eval()


def test_positions_are_transformers_rope_index(vl_folder):
    from swift_mcore.models import vision

    config = json.loads((vl_folder / "config.json").read_text())
    vl = vision.VisionLanguage.from_hf_config(config)
    hf = transformers_model(vl_folder).model
    # two images of other shapes (wider, taller), text between and after; a batch of two
    ids, _, grids = image_prompt([(1, 4, 8), (1, 6, 2)])
    other, _, other_grids = image_prompt([(1, 2, 2)], text=(9, 2, 10), seed=1)
    other = torch.cat([other, torch.zeros(1, ids.shape[1] - other.shape[1],
                                          dtype=torch.long)], dim=1)
    batch, all_grids = torch.cat([ids, other]), torch.cat([grids, other_grids])
    theirs, _ = hf.get_rope_index(batch, mm_token_type_ids=(batch == IMAGE).int(),
                                  image_grid_thw=all_grids)
    assert torch.equal(vision.rope_index(batch, all_grids, vl), theirs)
    text = torch.randint(0, 290, (1, 7))
    assert torch.equal(vision.rope_index(text, None, vl), torch.arange(7).expand(3, 1, 7))
    with pytest.raises(ValueError, match="do not match the images' grids"):
        vision.rope_index(ids, grids[:1], vl)


def test_logits_match_transformers_with_images_and_without(gloo_group, vl_folder):
    model, _, _ = load_ours(vl_folder)
    hf = transformers_model(vl_folder)
    ids, pixels, grids = image_prompt([(1, 4, 8), (1, 6, 2)])
    with torch.no_grad():
        theirs = hf(input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
                    mm_token_type_ids=(ids == IMAGE).int()).logits
        ours = model(input_ids=ids, position_ids=None, attention_mask=None,
                     pixel_values=pixels, image_grid_thw=grids)[..., :320]
    assert (ours - theirs).abs().max() <= 1e-4
    # the image matters: other pixels give other logits after the first image
    with torch.no_grad():
        blind = model(input_ids=ids, position_ids=None, attention_mask=None,
                      pixel_values=pixels.flip(0), image_grid_thw=grids)[..., :320]
    assert (blind - theirs).abs().max() > 1e-2
    text = H.tokens(vocab=290, batch=2, length=24)
    with torch.no_grad():
        theirs = hf(input_ids=text).logits
        ours = model(input_ids=text, position_ids=None, attention_mask=None)[..., :320]
    assert (ours - theirs).abs().max() <= 1e-4


def test_weights_round_trip_bit_for_bit(gloo_group, vl_folder):
    """HF files -> the model's parameters -> HF tensors: every tensor of the folder, each
    equal to the file's, and nothing else."""
    from swift_mcore.models import vision

    model, layout, _ = load_ours(vl_folder)
    params = dict(model.named_parameters())
    original = H.safetensors_state(str(vl_folder))
    names = dict(vision.hf_tensors(layout, vision.vision_shapes(model)))
    assert sorted(names) == sorted(original)
    for name, tensor in original.items():
        back = vision.to_hf(layout, name, lambda n: params[n].detach())
        assert tuple(back.shape) == names[name] and torch.equal(back, tensor), name


@pytest.mark.parametrize("change, message", [
    (dict(image_token_id=400), "image_token_id 400 .*below vocab_size 320"),
    (dict(text_config=dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                  "mrope_section": [2, 2, 2]})),
     r"mrope_section \[2, 2, 2\] .*head_dim / 2 = 8"),
    (dict(vision_config=dict(VISION, out_hidden_size=32)),
     "vision_config.out_hidden_size 32 .*hidden_size 64"),
])
def test_configs_it_cannot_build_are_named(vl_folder, change, message):
    from swift_mcore.models import vision
    from swift_mcore.models.families import UnsupportedConfig

    config = {**json.loads((vl_folder / "config.json").read_text()), **change}
    with pytest.raises(UnsupportedConfig, match=message):
        vision.VisionLanguage.from_hf_config(config)
