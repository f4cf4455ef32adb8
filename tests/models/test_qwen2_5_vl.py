"""Qwen2.5-VL (models/vision.py): a tiny random folder built from transformers' config gives
transformers' logits on an image prompt and on text alone, its 3-D positions are
transformers' get_rope_index's, and its weights go HF -> model -> HF bit for bit."""

import json

import pytest
import torch

import hf_helpers as H
from swift_mcore.errors import ArgumentError

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


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_processor_files(path):
    """The tiny BPE with Qwen2.5-VL's special tokens at the config's ids, a ChatML template,
    and transformers' PIL image processor (4x4 patches, 2x2 merged, at most 32x32 pixels)."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    H.write_tokenizer(str(path))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.add_tokens([f"<|filler_{i}|>" for i in range(IMAGE - len(tokenizer))])
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>",
        "<|im_start|>", "<|im_end|>"]})
    assert tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|vision_start|>",
                                            "<|vision_end|>"]) == [IMAGE, START, END]
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(str(path))
    Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                             min_pixels=8 * 8, max_pixels=32 * 32).save_pretrained(str(path))


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl") / "hf"
    make_qwen2_5_vl(path)
    write_processor_files(path)
    return path


def load_ours(folder):
    """Our model for ``folder``, its weights read from the files; and its layout."""
    from swift_mcore.arguments import RunArguments
    from swift_mcore.models import vision
    from swift_mcore.models.convert import Layout
    from swift_mcore.models.families import by_name
    from swift_mcore.models.gpt import build_model
    from swift_mcore.models.hf_folder import HFFolder
    from swift_mcore.run_config import resolve

    hf = HFFolder(str(folder))
    vl = vision.VisionLanguage.from_hf_config(hf.config)
    values = by_name("qwen2_5_vl").model_values(hf.config, None)
    assert {k: v for k, v in values.items() if k not in vl.flags()} == {
        **vision.language_values(hf.config), "model_type": "qwen2_5_vl",
        "position_embedding_type": "mrope"}
    flags = RunArguments.from_flags(**values, precision="fp32", seq_length=128)
    config = resolve(flags, world_size=1, weights_only=True).complete(values["vocab_size"],
                                                                      None)
    model = build_model(config, initialize=False)[0]
    layout = Layout.from_model_args(config.model, config.padded_vocab_size)
    with hf.reader() as reader, torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(layout.to_mcore(name, reader.read))
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
    model, layout, _ = load_ours(vl_folder)
    params = dict(model.named_parameters())
    original = H.safetensors_state(str(vl_folder))
    names = dict(layout.hf_tensors())
    assert sorted(names) == sorted(original)
    tower = sorted(n for n in params if n.startswith("visual."))
    assert tower and tower == sorted(n for n in original if n.startswith("visual."))
    for name, tensor in original.items():
        back = layout.to_hf(name, lambda n: params[n].detach())
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


# ---- image rows (data/multimodal.py) ------------------------------------------------------

def write_image(path, width, height, seed=0):
    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(str(path))
    return str(path)


def encoder_for(folder):
    from transformers import AutoImageProcessor

    from swift_mcore.data.multimodal import ImageEncoder
    from swift_mcore.data.templates import Template
    from swift_mcore.data.tokenizer import load_tokenizer

    return ImageEncoder(Template("tokenizer", load_tokenizer(str(folder))),
                        AutoImageProcessor.from_pretrained(str(folder)))


def test_image_rows_encode_as_transformers_and_give_its_logits(gloo_group, vl_folder, tmp_path):
    """An ms-swift row (<image> tags, an images list) and the same row as transformers'
    content lists encode alike: the image processor's patches, each pad expanded to its
    grid's tokens, the answer alone trained; the sample gives transformers' logits."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from swift_mcore.data.multimodal import read_image_row

    wide, tall = write_image(tmp_path / "wide.png", 30, 14), write_image(tmp_path / "t.png", 9, 26)
    row = {"messages": [{"role": "user", "content": "<image>add<image> them"},
                        {"role": "assistant", "content": "def add(a, b)"}],
           "images": [wide, tall]}
    listed = {"messages": [{"role": "user", "content": [
        {"type": "image", "image": wide}, {"type": "text", "text": "add"},
        {"type": "image", "path": tall}, {"type": "text", "text": " them"}]},
        {"role": "assistant", "content": "def add(a, b)"}]}
    import base64

    inline = dict(row, images=[wide, "data:image/png;base64," + base64.b64encode(
        open(tall, "rb").read()).decode()])
    encoder = encoder_for(vl_folder)
    ours = encoder.encode(read_image_row(row, "row 0"))
    for other in (listed, inline):
        again = encoder.encode(read_image_row(other, "row 1"))
        assert torch.equal(torch.from_numpy(ours.ids), torch.from_numpy(again.ids))
        assert torch.equal(ours.pixel_values, again.pixel_values)

    from PIL import Image

    processor = AutoImageProcessor.from_pretrained(str(vl_folder))
    reference = processor(images=[Image.open(wide).convert("RGB"),
                                  Image.open(tall).convert("RGB")], return_tensors="pt")
    assert torch.equal(ours.pixel_values, reference["pixel_values"])
    assert torch.equal(ours.image_grid_thw, reference["image_grid_thw"])
    counts = (reference["image_grid_thw"].prod(-1) // 4).tolist()
    assert counts[0] != counts[1]
    tokenizer = AutoTokenizer.from_pretrained(str(vl_folder))
    pads = ["<|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>" for n in counts]
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{pads[0]}add{pads[1]} them"},
         {"role": "assistant", "content": "def add(a, b)"}], tokenize=False)
    assert ours.ids.tolist() == tokenizer.encode(expected, add_special_tokens=False)
    trained = tokenizer.decode(ours.ids[ours.targets].tolist())
    assert trained.startswith("def add(a, b)<|im_end|>") and not (
        ours.ids[ours.targets] == IMAGE).any()

    model, _, _ = load_ours(vl_folder)
    ids = torch.from_numpy(ours.ids).long()[None]
    with torch.no_grad():
        theirs = transformers_model(vl_folder)(
            input_ids=ids, pixel_values=ours.pixel_values, image_grid_thw=ours.image_grid_thw,
            mm_token_type_ids=(ids == IMAGE).int()).logits
        logits = model(input_ids=ids, position_ids=None, attention_mask=None,
                       pixel_values=ours.pixel_values,
                       image_grid_thw=ours.image_grid_thw)[..., :320]
    assert (logits - theirs).abs().max() <= 1e-4


def _bad_rows(tmp_path):
    image = write_image(tmp_path / "ok.png", 12, 12)
    (tmp_path / "notes.png").write_text("not an image")
    os_fifo = tmp_path / "pipe.png"
    import os

    os.mkfifo(os_fifo)
    user = lambda text: [{"role": "user", "content": text},  # noqa: E731
                         {"role": "assistant", "content": "ok"}]
    missing = str(tmp_path / "gone.png")
    wide = write_image(tmp_path / "wide.png", 804, 4)  # 201:1, over smart_resize's 200
    import base64

    inline = "data:image/png;base64," + base64.b64encode(open(wide, "rb").read()).decode()
    return [
        ({"messages": user("<image>hi"), "images": [wide]},
         r"row 7: images\[0\] .*wide.png: 804x4 pixels, a side more than 200 times"),
        ({"messages": user("<image>hi"), "images": [inline]},
         r"row 7: images\[0\]: 804x4 pixels, a side more than 200 times"),
        ({"messages": user("<image>hi"), "images": [missing]},
         f"row 7: images\\[0\\] {missing}: cannot be read \\(No such file"),
        ({"messages": user("<image><image>hi"), "images": [image]},
         "row 7: 2 <image> tag\\(s\\) in the messages but 1 image\\(s\\)"),
        ({"messages": user("hi"), "images": [image]},
         "row 7: 0 <image> tag\\(s\\) in the messages but 1 image"),
        ({"messages": user("<image>hi"), "images": ["https://x.org/a.png"]},
         "row 7: images\\[0\\]: https://x.org/a.png is a URL"),
        ({"messages": user("<image>hi"), "images": [str(tmp_path / "notes.png")]},
         "notes.png: not an image PIL can read"),
        ({"messages": user("<image>hi"), "images": [str(os_fifo)]},
         "pipe.png: is a FIFO"),
        ({"messages": user("<video>hi")}, r"row 7: 1 <video> tag\(s\) in the messages but "
                                          r"0 video\(s\) in 'videos'"),
        ({"messages": [{"role": "user", "content": "hi"},
                       {"role": "assistant", "content": "<image>"}], "images": [image]},
         r"row 7: messages\[1\] \(assistant\) holds <image>"),
        ({"messages": user([{"type": "audio", "audio": "a.wav"}])},
         r"row 7: messages\[0\].content\[0\]: "),
        ({"messages": user("<image>hi"), "images": [3]},
         r"row 7: images\[0\]: 3 is not an image path"),
        ({"messages": user("<image>hi"), "images": ["data:image/png;base64,!!"]},
         r"row 7: images\[0\]: a data:image URI whose payload is not valid base64"),
        ({"messages": user("<image>hi"), "images": ["data:image/png;base64,aGVsbG8="]},
         r"row 7: images\[0\]: not an image PIL can read"),
        ({"messages": user("<image>hi"), "images": ["data:text/plain;base64,aGk="]},
         r"row 7: images\[0\]: data:text/plain;base64,aGk= is a URL"),
    ]


def test_images_of_every_kind_encode_as_transformers_reads_their_paths(vl_folder, tmp_path):
    """A portrait JPEG stored sideways (EXIF orientation 6) is turned upright, as
    transformers' processors read a path or a base64 image; RGBA, palette with
    transparency, 16-bit grey, CMYK and animated images give its patches too, read from
    the files (training, infer) or from the cache's bytes."""
    import base64

    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor

    from swift_mcore.data.image_cache import picture
    from swift_mcore.data.multimodal import read_image_row

    rs = np.random.RandomState(0)
    rgb = lambda: Image.fromarray(rs.randint(0, 256, (14, 30, 3), dtype=np.uint8))  # noqa
    sideways = rgb()
    exif = sideways.getexif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view
    sideways.save(tmp_path / "phone.jpg", exif=exif)
    Image.fromarray(rs.randint(0, 256, (14, 30, 4), dtype=np.uint8), "RGBA").save(
        tmp_path / "rgba.png")
    rgb().convert("P").save(tmp_path / "palette.png", transparency=3)
    Image.fromarray(rs.randint(0, 65535, (14, 30), dtype=np.uint16)).save(tmp_path / "16.png")
    rgb().convert("CMYK").save(tmp_path / "cmyk.jpg")
    rgb().save(tmp_path / "anim.gif", save_all=True, append_images=[rgb(), rgb()])
    encoder = encoder_for(vl_folder)
    processor = AutoImageProcessor.from_pretrained(str(vl_folder))
    for name in ("phone.jpg", "rgba.png", "palette.png", "16.png", "cmyk.jpg", "anim.gif"):
        path = str(tmp_path / name)
        reference = processor(images=[path], return_tensors="pt")
        data = open(path, "rb").read()
        inline = "data:image/x;base64," + base64.b64encode(data).decode()
        for ref in (path, inline):
            ours = encoder.encode(read_image_row(
                {"messages": [{"role": "user", "content": "<image>hi"},
                              {"role": "assistant", "content": "ok"}], "images": [ref]},
                "row 0"))
            assert torch.equal(ours.image_grid_thw, reference["image_grid_thw"]), name
            assert torch.equal(ours.pixel_values, reference["pixel_values"]), name
        cached = processor(images=[picture(data, name)], return_tensors="pt")
        assert torch.equal(cached["pixel_values"], reference["pixel_values"]), name
    # upright, the 30x14 photo is 14 wide and 30 high: its grid is tall
    assert encoder.patches([str(tmp_path / "phone.jpg")])[1].tolist() == [[1, 8, 4]]
    # a file cut short passes the header check when the row is read; its pixels are
    # refused when decoded, naming the row and the image (it was PIL's traceback)
    whole = open(tmp_path / "rgba.png", "rb").read()
    (tmp_path / "cut.png").write_bytes(whole[:len(whole) // 2])
    item = read_image_row({"messages": [{"role": "user", "content": "<image>hi"},
                                        {"role": "assistant", "content": "ok"}],
                           "images": [str(tmp_path / "cut.png")]}, "row 3")
    with pytest.raises(ArgumentError, match=r"^row 3: images\[0\] .*cut.png: not an image PIL "
                                            r"can read \(image file is truncated"):
        encoder.encode(item)


def test_an_image_given_as_bytes_is_its_bytes_not_its_old_path(vl_folder, tmp_path,
                                                               monkeypatch):
    """A datasets Image column (parquet) holds {"bytes", "path"}: the path is the name of
    the file the image once came from; the bytes are trained, even where another file of
    that name exists (it was read instead)."""
    from swift_mcore.data.multimodal import read_image_row

    monkeypatch.chdir(tmp_path)
    real = write_image(tmp_path / "real.png", 12, 20, seed=1)
    write_image(tmp_path / "x.png", 12, 20, seed=2)  # another image under the old name
    user = [{"role": "user", "content": "<image>hi"}, {"role": "assistant", "content": "ok"}]
    encoder = encoder_for(vl_folder)
    held = encoder.encode(read_image_row({"messages": user, "images": [
        {"bytes": open(real, "rb").read(), "path": "x.png"}]}, "row 0"))
    assert torch.equal(held.pixel_values, encoder.encode(read_image_row(
        {"messages": user, "images": [real]}, "row 0")).pixel_values)


def test_trl_rows_take_their_images_from_the_column(vl_folder, tmp_path):
    """TRL's vision rows (content lists whose {"type": "image"} items name no file, the
    images in the 'images' column, in order) encode as the same ms-swift row; they were
    refused. Items that name files and a column together, or items half naming, are not."""
    from swift_mcore.data.multimodal import read_image_row

    a, b = write_image(tmp_path / "a.png", 12, 20), write_image(tmp_path / "b.png", 20, 8)
    answer = {"role": "assistant", "content": [{"type": "text", "text": "ok", "index": None}]}
    trl = {"messages": [{"role": "user", "content": [
        {"type": "image", "text": None, "index": 0}, {"type": "text", "text": "and"},
        {"type": "image", "text": None, "index": 1}]}, answer], "images": [a, b]}
    swift = {"messages": [{"role": "user", "content": "<image>and<image>"},
                          {"role": "assistant", "content": "ok"}], "images": [a, b]}
    encoder = encoder_for(vl_folder)
    ours, same = (encoder.encode(read_image_row(r, "row 0")) for r in (trl, swift))
    assert ours.ids.tolist() == same.ids.tolist()
    assert torch.equal(ours.pixel_values, same.pixel_values)
    assert torch.equal(ours.image_grid_thw, same.image_grid_thw)
    half = [{"type": "image"}, {"type": "image", "image": a}]
    for row, message in (
            (dict(trl, images=[a]), r"row 5: 2 <image> tag\(s\) in the messages but 1 image"),
            ({"messages": [{"role": "user", "content": half}, answer], "images": [b]},
             r"row 5: some image items in the messages' content lists name their image and "
             r"some do not"),
            ({"messages": [{"role": "user", "content": half[1:]}, answer], "images": [b]},
             r"row 5: both an 'images'/'videos' column and media items naming their files")):
        with pytest.raises(ArgumentError, match=message):
            read_image_row(row, "row 5")


def test_bad_image_rows_are_named_before_any_work(tmp_path):
    from swift_mcore.data.multimodal import read_image_row
    from swift_mcore.errors import ArgumentError

    for row, message in _bad_rows(tmp_path):
        with pytest.raises(ArgumentError, match=message):
            read_image_row(row, "row 7")


# ---- the folder through the commands (family qwen2_5_vl) ---------------------------------

def test_folder_loads_as_one_model_and_exports_bit_for_bit(gloo_group, vl_folder, tmp_path):
    """`--model FOLDER`: the family sets the language model's flags and the vision ones;
    load_model builds the tower inside; HF -> checkpoint -> HF gives every tensor back and a
    config.json (and processor files) transformers loads to the same logits."""
    from transformers import AutoImageProcessor

    from swift_mcore.loaded_model import load_model

    loaded = load_model(str(vl_folder), log=lambda line: None)
    m = loaded.config.model
    assert (m.model_type, m.position_embedding_type, m.mrope_section) == (
        "qwen2_5_vl", "mrope", "[2,3,3]")
    ids, pixels, grids = image_prompt([(1, 4, 8), (1, 6, 2)])
    with torch.no_grad():
        ours = loaded.model(input_ids=ids, position_ids=None, attention_mask=None,
                            pixel_values=pixels, image_grid_thw=grids)[..., :320]
        theirs = transformers_model(vl_folder)(
            input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
            mm_token_type_ids=(ids == IMAGE).int()).logits
    assert (ours - theirs).abs().max() <= 1e-4

    config = H.check_round_trip(vl_folder, tmp_path)
    source = json.loads((vl_folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert config["vision_config"] == source["vision_config"]
    for key in ("image_token_id", "video_token_id", "vision_start_token_id",
                "vision_end_token_id", "tie_word_embeddings"):
        assert config[key] == source[key], key
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]
    back = tmp_path / "back"
    with torch.no_grad():
        again = transformers_model(back)(
            input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
            mm_token_type_ids=(ids == IMAGE).int()).logits
    assert torch.equal(again, theirs)
    assert AutoImageProcessor.from_pretrained(str(back)).to_dict() == \
        AutoImageProcessor.from_pretrained(str(vl_folder)).to_dict()


# ---- sft on image rows --------------------------------------------------------------------

def image_dataset(tmp_path, rows=16, size=16, seed=0):
    """rows image conversations (each its own random image of size x size pixels)."""
    lines = []
    for i in range(rows):
        image = write_image(tmp_path / f"img{seed}_{i}.png", size, size, seed=seed + i)
        lines.append(json.dumps({
            "messages": [{"role": "user", "content": f"<image>what is {i}?"},
                         {"role": "assistant", "content": f"def add(a, b): {i % 3}"}],
            "images": [image]}))
    data = tmp_path / f"images{seed}.jsonl"
    data.write_text("\n".join(lines) + "\n")
    return data


def test_sft_with_images_trains_and_resumes_exactly(tmp_path, train_here, vl_folder):
    """sft on image rows: the loss is computed on the answers with the images in the
    model; resumed from step 2 it logs steps 3 and 4 exactly as the straight run."""
    from run_helpers import losses
    from test_hf_training import run_flags

    data = image_dataset(tmp_path)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    flags = ["--model", vl_folder, "--dataset", data, "--seq_length", "64", "--lr", "1e-2",
             "--min_lr", "1e-2", "--train_iters", "4", "--template", "tokenizer"]
    train_here(straight, *flags, "--save_steps", "2", base=run_flags())
    train_here(resumed, *flags, "--no_save", "--resume",
               straight / "checkpoint" / "iter_0000002", base=run_flags())
    first, second = losses(straight), losses(resumed)
    assert sorted(first) == [1, 2, 3, 4] and sorted(second) == [3, 4]
    assert second == {3: first[3], 4: first[4]}
    assert first[4] < first[1]
    # the images are in the model: other pixels, the same text, another first loss
    other = tmp_path / "other"
    train_here(other, *flags[:3], image_dataset(tmp_path, seed=100), *flags[4:-4],
               "--train_iters", "1", "--template", "tokenizer", "--no_save", base=run_flags())
    assert losses(other)[1] != first[1]


def test_frozen_parts_stay_bit_for_bit(tmp_path, train_here, vl_folder):
    """Full sft trains the language model and keeps the tower and merger (ms-swift's
    defaults); --freeze_vit false --freeze_llm true trains the tower's blocks alone; LoRA's
    adapters, merged on export, change the language model only."""
    from test_hf_training import run_flags

    data = image_dataset(tmp_path, rows=8)
    source = H.safetensors_state(str(vl_folder))
    flags = ["--model", vl_folder, "--dataset", data, "--seq_length", "64", "--lr", "1e-2",
             "--min_lr", "1e-2", "--train_iters", "1", "--template", "tokenizer",
             "--save_steps", "1"]
    for name, extra, changed in (("default", [], {"llm"}),
                                 ("vit", ["--freeze_vit", "false", "--freeze_llm", "true"],
                                  {"vit"}),
                                 ("lora", ["--tuner_type", "lora"], {"llm"})):
        out = tmp_path / name
        train_here(out, *flags, *extra, base=run_flags())
        H.convert(out / "checkpoint", tmp_path / f"{name}_hf", "to_hf",
                  **({"merge_lora": True} if name == "lora" else {}))
        exported = H.safetensors_state(str(tmp_path / f"{name}_hf"))
        from swift_mcore.models.vision import part_of

        moved = {part_of(n[len("model."):] if n.startswith("model.") else n)
                 for n, t in source.items() if not torch.equal(exported[n], t)}
        assert moved == changed, (name, moved)


def test_freeze_flags_are_checked(vl_folder):
    from swift_mcore.arguments import RunArguments
    from swift_mcore.errors import ArgumentError
    from swift_mcore.run_config import resolve

    with pytest.raises(ArgumentError, match="--freeze_vit False is a flag of vision-language "
                                            "models; this is a text model"):
        resolve(RunArguments.from_flags(freeze_vit=False), world_size=1)
    # the defaults restated (as a checkpoint's saved flags do) are no request
    resolve(RunArguments.from_flags(freeze_vit=True, freeze_llm=False), world_size=1)
    resolve(RunArguments.from_flags(model=str(vl_folder), tuner_type="lora", freeze_vit=True),
            world_size=1)
    with pytest.raises(ArgumentError, match="leave nothing to train"):
        resolve(RunArguments.from_flags(model=str(vl_folder), freeze_llm=True), world_size=1)
    with pytest.raises(ArgumentError, match="nothing to put adapters on"):
        resolve(RunArguments.from_flags(model=str(vl_folder), freeze_llm=True,
                                        tuner_type="lora"), world_size=1)
    with pytest.raises(ArgumentError, match="--freeze_llm True with --target_regex"):
        resolve(RunArguments.from_flags(model=str(vl_folder), freeze_llm=True,
                                        freeze_vit=False, tuner_type="lora",
                                        target_regex=".*linear_qkv"), world_size=1)
    # the tower on the first pipeline stage (Qwen2.5-VL has no deepstack layers)
    resolve(RunArguments.from_flags(model=str(vl_folder), pipeline_model_parallel_size=2),
            world_size=2)
    # and with context parallelism: the tower sees the whole row, then it is split
    resolve(RunArguments.from_flags(model=str(vl_folder), context_parallel_size=2),
            world_size=2)
    # sequence parallelism splits the sequence after the image features enter it
    resolve(RunArguments.from_flags(model=str(vl_folder), tensor_model_parallel_size=2,
                                    sequence_parallel=True), world_size=2)
    from swift_mcore.arguments.sft import SftArguments

    with pytest.raises(ArgumentError, match="--streaming with a vision-language model"):
        resolve(SftArguments.from_flags(model=str(vl_folder), streaming=True, train_iters=2,
                                        dataset=["rows.jsonl"]), world_size=1)


def test_packed_image_rows_give_each_samples_logits(gloo_group, vl_folder):
    """Two image prompts in one row, kept apart by the block-causal mask, with text
    positions restarting at the second: each gets the logits it has alone (its 3-D
    positions restart too)."""
    from swift_mcore.data.packing import block_causal_mask

    model, _, _ = load_ours(vl_folder)
    first, pixels1, grids1 = image_prompt([(1, 4, 8)], seed=1)
    second, pixels2, grids2 = image_prompt([(1, 6, 2), (1, 2, 2)], seed=2)
    n1, n2 = first.shape[1], second.shape[1]
    row = torch.cat([first, second], dim=1)
    positions = torch.cat([torch.arange(n1), torch.arange(n2)])[None]
    segments = torch.tensor([[0] * n1 + [1] * n2])
    with torch.no_grad():
        packed = model(input_ids=row, position_ids=positions,
                       attention_mask=block_causal_mask(segments),
                       pixel_values=torch.cat([pixels1, pixels2]),
                       image_grid_thw=torch.cat([grids1, grids2]))
        alone = [model(input_ids=ids, position_ids=None, attention_mask=None,
                       pixel_values=p, image_grid_thw=g)
                 for ids, p, g in ((first, pixels1, grids1), (second, pixels2, grids2))]
    assert (packed[:, :n1] - alone[0]).abs().max() <= 1e-5
    assert (packed[:, n1:] - alone[1]).abs().max() <= 1e-5
    # the second sample's 3-D positions are those it has alone (transformers' per sample)
    from swift_mcore.models import vision

    both = vision.rope_index(row, torch.cat([grids1, grids2]), model.vl, positions)
    assert torch.equal(both[:, :, n1:], vision.rope_index(second, grids2, model.vl))


def test_an_image_longer_than_seq_length_is_named(tmp_path, train_here, vl_folder):
    from swift_mcore.errors import ArgumentError
    from test_hf_training import run_flags

    data = image_dataset(tmp_path, rows=2, size=32)  # 8x8 patches: 16 image tokens
    with pytest.raises(ArgumentError, match=r"images0.jsonl, row 0: \d+ tokens \(16 of them "
                                            r"its images'\), more than --seq_length 48 "
                                            r"\(images are not cut, nor their rows dropped, "
                                            r"whatever --truncation_strategy\)"):
        train_here(tmp_path / "out", "--model", vl_folder, "--dataset", data,
                   "--seq_length", "48", "--train_iters", "1", "--template", "tokenizer",
                   base=run_flags())
    assert not (tmp_path / "out" / "checkpoint").exists()
    # --max_pixels 256 scales them to 16x16 pixels: 4 image tokens, the rows fit
    train_here(tmp_path / "small", "--model", vl_folder, "--dataset", data, "--seq_length",
               "48", "--train_iters", "1", "--template", "tokenizer", "--max_pixels", "256",
               "--no_save", base=run_flags())


def test_min_pixels_above_max_pixels_is_named(vl_folder):
    """transformers' smart_resize drops the minimum (or the maximum) without a word when
    one is above the other: the flag and the folder's value are named instead."""
    from types import SimpleNamespace

    from swift_mcore.data.image_cache import image_processor

    sizes = lambda **kw: SimpleNamespace(**{"min_pixels": None, "max_pixels": None, **kw})  # noqa
    with pytest.raises(ArgumentError, match=r"^--min_pixels 2048 is above .*hf/"
                                            r"preprocessor_config.json's longest_edge 1024"):
        image_processor(str(vl_folder), sizes(min_pixels=2048))
    with pytest.raises(ArgumentError, match=r"preprocessor_config.json's shortest_edge 64 is "
                                            r"above --max_pixels 32"):
        image_processor(str(vl_folder), sizes(max_pixels=32))
    with pytest.raises(ArgumentError, match=r"^--min_pixels 512 is above --max_pixels 256"):
        image_processor(str(vl_folder), sizes(min_pixels=512, max_pixels=256))
    assert image_processor(str(vl_folder), sizes(min_pixels=256, max_pixels=256)).size[
        "longest_edge"] == 256
    # every image scaled up past the largest an image may have ran out of memory
    with pytest.raises(ArgumentError, match=r"^--min_pixels 400000000 is above 67108864 "
                                            r"pixels, the most an image may have"):
        image_processor(str(vl_folder), sizes(min_pixels=4 * 10 ** 8, max_pixels=4 * 10 ** 8))


@pytest.mark.parametrize("text, message", [
    (None, r"preprocessor_config.json is missing: a vision-language model's folder"),
    ("{", r"preprocessor_config.json: transformers cannot read it \(.*not a valid JSON"),
    ("[]", r"preprocessor_config.json: transformers cannot read it"),
    ('{"image_processor_type": "CLIPImageProcessor"}',
     r"preprocessor_config.json: patch_size is None in a CLIPImageProcessor"),
    ('{"image_processor_type": "Qwen2VLImageProcessor", "patch_size": "x", "merge_size": 2, '
     '"temporal_patch_size": 2}', r"preprocessor_config.json: patch_size is 'x' in a Qwen2VL"),
])
def test_a_bad_preprocessor_config_is_named(tmp_path, text, message):
    """The model folder's image processor file missing, not JSON or not a Qwen VL image
    processor's: named with --model before any row is encoded (it was a traceback)."""
    from types import SimpleNamespace

    from swift_mcore.data.image_cache import image_processor

    if text is not None:
        (tmp_path / "preprocessor_config.json").write_text(text)
    with pytest.raises(ArgumentError, match=f"^--model {tmp_path}: {message}"):
        image_processor(str(tmp_path), SimpleNamespace(min_pixels=None, max_pixels=None))


def transformers_greedy_answer(hf, folder, image, prompt: str, steps: int,
                               before: str = "") -> str:
    """The answer transformers' model ``hf`` gives greedily in ``steps`` tokens to ``prompt``
    after ``before`` and ``image`` (the whole sequence each step, as infer runs it), up to
    its <|im_end|>."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    patches = AutoImageProcessor.from_pretrained(str(folder))(
        images=[Image.open(image).convert("RGB")], return_tensors="pt")
    pads = int(patches["image_grid_thw"].prod()) // 4
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": before + "<|vision_start|>" + "<|image_pad|>" * pads
          + "<|vision_end|>" + prompt}], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    new = []
    with torch.no_grad():
        for _ in range(steps):
            logits = hf(input_ids=ids, mm_token_type_ids=(ids == IMAGE).int(),
                        **patches).logits[0, -1, :306]
            new.append(int(logits.argmax()))
            ids = torch.cat([ids, torch.tensor([[new[-1]]])], dim=1)
    return tokenizer.decode([t for t in new if t != tokenizer.eos_token_id]).split(
        "<|im_end|>")[0]


def test_infer_with_an_image_gives_transformers_greedy_tokens(gloo_group, capsys, vl_folder,
                                                               tmp_path):
    from swift_mcore.arguments.infer import InferArguments
    from swift_mcore.infer import run

    image = write_image(tmp_path / "cat.png", 20, 12)
    answer = run(InferArguments(model=str(vl_folder), prompt="what is it?", image=image,
                                template="tokenizer", max_new_tokens=5).validate())
    expected = transformers_greedy_answer(transformers_model(vl_folder), vl_folder, image,
                                          "what is it?", 5)
    assert answer and answer == expected, (answer, expected)
    with pytest.raises(ArgumentError, match="--image needs --template"):
        InferArguments(model=str(vl_folder), prompt="hi", image=image).validate()
    with pytest.raises(ArgumentError, match=r"--image .*gone.png: cannot be read"):
        run(InferArguments(model=str(vl_folder), prompt="hi", image=str(tmp_path / "gone.png"),
                           template="tokenizer").validate())


def test_infer_sizes_images_as_the_checkpoint_was_trained(tmp_path, train_here, vl_folder,
                                                          monkeypatch, capsys):
    """A checkpoint trained with --max_pixels 256 sees infer's --image at 256 pixels too
    (it was the folder's 1024: an image larger than any it was trained on)."""
    from test_hf_training import run_flags

    from swift_mcore.arguments.infer import InferArguments
    from swift_mcore.data.multimodal import ImageEncoder
    from swift_mcore.infer import run

    train_here(tmp_path / "out", "--model", vl_folder, "--dataset",
               image_dataset(tmp_path, rows=4), "--seq_length", "48", "--train_iters", "1",
               "--template", "tokenizer", "--max_pixels", "256", "--save_steps", "1",
               base=run_flags())
    grids = []
    patches = ImageEncoder.patches
    monkeypatch.setattr(ImageEncoder, "patches", lambda self, *a, **k: grids.append(
        patches(self, *a, **k)[1].tolist()) or patches(self, *a, **k))
    image = write_image(tmp_path / "cat.png", 32, 32)
    for model in (tmp_path / "out" / "checkpoint", vl_folder):
        run(InferArguments(model=str(model), prompt="hi", image=image, template="tokenizer",
                           max_new_tokens=1).validate())
    assert grids == [[[1, 4, 4]], [[1, 8, 8]]]  # 16x16 pixels; the folder's own 32x32


def test_infer_puts_the_image_where_the_prompt_says_and_refuses_its_tokens(
        gloo_group, capsys, vl_folder, tmp_path):
    """--prompt "TEXT<image>TEXT" shows the image there (ms-swift's tag); the prompt or the
    system writing the image's own tokens, or two tags, is refused naming the flag (it
    was a traceback deep in the model)."""
    from swift_mcore.arguments.infer import InferArguments
    from swift_mcore.infer import run

    image = write_image(tmp_path / "cat.png", 20, 12)
    answer = run(InferArguments(model=str(vl_folder), prompt="look: <image>what is it?",
                                image=image, template="tokenizer", max_new_tokens=5).validate())
    expected = transformers_greedy_answer(transformers_model(vl_folder), vl_folder, image,
                                          "what is it?", 5, before="look: ")
    assert answer and answer == expected, (answer, expected)
    for prompt, system, message in (
            ("<|image_pad|>hi", None, r"--prompt/--system write <\|image_pad\|> themselves "
                                      r"\(2 in the prompt, 1 from --image\); write <image>"),
            ("hi", "<|video_pad|>", r"write <\|video_pad\|> themselves \(1 in the prompt, 0"),
            ("<image>a<image>", None, r"--prompt holds 2 <image> and 0 <video> tag\(s\); "
                                      r"--image is one image"),
            ("<video>a", None, r"--prompt holds 0 <image> and 1 <video>")):
        with pytest.raises(ArgumentError, match=message):
            run(InferArguments(model=str(vl_folder), prompt=prompt, system=system, image=image,
                               template="tokenizer", max_new_tokens=1).validate())
    whole = open(image, "rb").read()
    (tmp_path / "cut.png").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ArgumentError, match=r"^--image .*cut.png: not an image PIL can read"):
        run(InferArguments(model=str(vl_folder), prompt="hi", image=str(tmp_path / "cut.png"),
                           template="tokenizer", max_new_tokens=1).validate())


@pytest.mark.benchmark
def test_tp2_matches_transformers_and_exports_bit_identical(tmp_path, gloo_group, vl_folder):
    """TP=2 on gloo: the language model sharded, the tower whole on each rank; the logits
    of text are transformers', and the TP=2 checkpoint exports every tensor bit for bit."""
    from test_hf_parallel import run_two_ranks

    ids, out = run_two_ranks(tmp_path, vl_folder, 2, 1)
    with torch.no_grad():
        theirs = transformers_model(vl_folder)(input_ids=ids).logits
    assert (torch.load(out / "logits.pt") - theirs).abs().max() <= 1e-4
    H.convert(out, tmp_path / "exported", "to_hf")
    H.assert_same_weights(vl_folder, tmp_path / "exported")


@pytest.mark.slow
def test_language_model_adapters_export_as_peft_under_transformers_names(tmp_path, train_here,
                                                                          vl_folder):
    """LoRA on the language model of a vision-language folder: --to_peft names its modules
    as transformers' Qwen2_5_VLForConditionalGeneration holds them (model.language_model.*),
    so peft loads the adapter onto that model, which then gives the checkpoint's logits on
    text within 1e-4 (under model.layers.* peft would load nothing)."""
    from safetensors.torch import load_file

    from test_hf_training import run_flags

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(40)))
    out = tmp_path / "lora"
    train_here(out, "--model", vl_folder, "--dataset", data, "--seq_length", "32", "--lr",
               "2e-2", "--train_iters", "2", "--tuner_type", "lora", "--lora_rank", "4",
               command="pt", base=run_flags())
    H.convert(out / "checkpoint", tmp_path / "adapter", "to_peft")
    written = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert written and all(name.startswith("base_model.model.model.language_model.layers.")
                           for name in written)
    ids = H.tokens(length=20)
    H.check_peft_loads_the_checkpoint(out / "checkpoint", transformers_model(vl_folder),
                                      tmp_path / "adapter", ids)
