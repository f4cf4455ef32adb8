"""Qwen2.5-VL and Qwen3-VL videos (data/video.py, data/multimodal.py, models/vision.py):
frames read with PyAV and sampled by qwen_vl_utils' rule, patches equal to transformers'
image processor's on a still video, 3-D positions and logits equal to transformers' with
pixel_values_videos, rows in both formats (Qwen3-VL's with its processor's timestamps),
bad videos named before any work, sft and infer with a video."""

import json

import numpy as np
import pytest
import torch

from test_qwen2_5_vl import (  # noqa: F401  (vl_folder: the module's tiny folder)
    IMAGE,
    VIDEO,
    encoder_for,
    image_prompt,
    load_ours,
    transformers_model,
    vl_folder,
    write_image,
)
from test_qwen3_vl import vl3_folder  # noqa: F401  (the tiny Qwen3-VL folder)

# the tiny folder's patches are 4x4 pixels merged 2x2: frame sides are multiples of 8
SMALL = dict(video_min_pixels=64, video_max_pixels=1024, video_total_pixels=1 << 20)
COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (250, 200, 10), (7, 7, 7), (0, 128, 255),
           (90, 30, 160), (255, 255, 255), (30, 60, 90), (1, 2, 3)]


def write_video(path, frames, fps=4):
    """A lossless video (FFV1 in Matroska, 8-bit RGB as bgr0: no chroma subsampling, so
    every pixel decodes to what was written) of uint8 [h, w, 3] frames."""
    import av

    height, width = frames[0].shape[:2]
    with av.open(str(path), "w") as container:
        stream = container.add_stream("ffv1", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "bgr0"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return str(path)


def coloured(count, height=16, width=24):
    """``count`` frames, frame i all COLOURS[i] but for a random patch (so a frame is not
    one colour: the patch layout shows)."""
    rng = np.random.RandomState(0)
    frames = []
    for i in range(count):
        frame = np.empty((height, width, 3), np.uint8)
        frame[:] = COLOURS[i]
        frame[:4, :4] = rng.randint(0, 256, (4, 4, 3))
        frames.append(frame)
    return frames


def sampling(**extra):
    from swift_mcore.data.video import VideoSampling

    return VideoSampling(**{**SMALL, **extra})


def test_sampled_frames_decode_as_written_at_qwen_vl_utils_indices(tmp_path):
    """10 frames at 4 fps, --fps 2: 5 frames, floored to 4 (temporal_patch_size 2):
    round(linspace(0, 9, 4)) = 0, 3, 6, 9, each decoded to the exact pixels written
    (lossless codec); the rate of those frames, 4 / 10 * 4 fps, gives 1.25 s per temporal
    patch of 2 frames."""
    from swift_mcore.data.video import frame_count, frame_indices, read_video_file

    frames = coloured(10)
    path = write_video(tmp_path / "ten.mkv", frames)
    assert frame_count(10, 4.0, sampling(), 2, "v") == 4
    assert frame_indices(10, 4) == [0, 3, 6, 9]
    got = read_video_file(path, "v", sampling(), 8, 2, 3)
    assert [np.array(f).tolist() for f in got.images] == [frames[i].tolist()
                                                           for i in (0, 3, 6, 9)]
    assert got.sample_fps == pytest.approx(1.6)
    # --fps_min_frames raises the count (to 6), --fps_max_frames caps it (to 2)
    assert frame_count(10, 4.0, sampling(fps_min_frames=6), 2, "v") == 6
    assert frame_count(10, 4.0, sampling(fps_max_frames=3), 2, "v") == 2
    assert frame_indices(10, 6) == [0, 2, 4, 5, 7, 9]
    again = read_video_file(path, "v", sampling(fps_min_frames=6), 8, 2, 3)
    assert [np.array(f).tolist() for f in again.images] == [frames[i].tolist()
                                                             for i in (0, 2, 4, 5, 7, 9)]


FRAMES_PEAK = """
import resource, sys
from PIL import Image
from swift_mcore.data.multimodal import load_image
from swift_mcore.data.video import HeldFrame, VideoSampling, read_frame_list
path, count, held = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "held"
sampling = VideoSampling(video_min_pixels=64, video_max_pixels=256, video_total_pixels=1 << 20)
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
def frame():
    return HeldFrame(path) if held else path
read_frame_list([frame()], "v", sampling, 8, 2, Image.BICUBIC, load_image)  # imports, a frame
before = peak()
frames = read_frame_list([frame() for _ in range(count)], "v", sampling, 8, 2, Image.BICUBIC,
                         load_image)
assert len(frames.images) == count and frames.images[0].size == (16, 16), frames.images[0].size
print(peak() - before)
"""


@pytest.mark.parametrize("held", ["paths", "held"])
def test_a_frame_list_of_large_frames_holds_one_at_a_time(tmp_path, held):
    """A frame list of 24 frames of 3072x3072 pixels (a 20 KB PNG each, 27 MiB decoded),
    given as paths or read by the cache (HeldFrame: hashed and decoded from its bytes): each
    frame is resized as it is decoded and its bytes let go, so the peak memory grows by
    about one frame, not by the list's 650 MiB."""
    import subprocess
    import sys

    from PIL import Image
    from run_helpers import child_env

    path = tmp_path / "large.png"
    Image.new("RGB", (3072, 3072), (10, 20, 30)).save(path)
    out = subprocess.run([sys.executable, "-c", FRAMES_PEAK, str(path), "24", held],
                         env=child_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) < 200 << 20


def test_a_still_video_has_the_image_processors_patches(vl_folder, tmp_path):
    """A video of two identical frames (a file and a frame list) gives exactly the patches
    transformers' (slow, PIL) Qwen2-VL image processor gives the still image: at its size
    and scaled down (40x40 -> 32x32, both by PIL's bicubic)."""
    from PIL import Image
    from transformers import AutoImageProcessor

    from swift_mcore.data.video import Frames, patches, read_frame_list, read_video_file
    from swift_mcore.data.multimodal import load_image

    processor = AutoImageProcessor.from_pretrained(str(vl_folder))
    for size in ((16, 24), (40, 40)):
        still = coloured(1, *size)[0]
        reference = processor(images=[Image.fromarray(still)], return_tensors="pt")
        image = write_image(tmp_path / f"still{size[0]}.png", 1, 1)
        Image.fromarray(still).save(image)
        video = write_video(tmp_path / f"still{size[0]}.mkv", [still, still])
        for frames in (read_video_file(video, "v", sampling(), 8, 2, processor.resample),
                       read_frame_list([image, image], "v", sampling(), 8, 2,
                                       processor.resample, load_image),
                       read_frame_list([image], "v", sampling(), 8, 2, processor.resample,
                                       load_image)):
            ours, grid, _ = patches(frames, processor)
            assert list(grid) == reference["image_grid_thw"][0].tolist()
            assert torch.equal(ours, reference["pixel_values"])
    # distinct frames: each patch holds its two frames, first then second
    frames = coloured(2)
    ours, grid, seconds = patches(Frames([Image.fromarray(f) for f in frames], 2.0, [0, 1], 2.0),
                                  processor)
    alone = [processor(images=[Image.fromarray(f)], return_tensors="pt")["pixel_values"]
             for f in frames]
    half = alone[0].shape[1] // 2  # [C, temporal, p, p]: per channel, frame 0 then 1
    ours_c = ours.view(ours.shape[0], 3, 2, -1)
    assert torch.equal(ours_c[:, :, 0], alone[0].view(ours.shape[0], 3, 2, -1)[:, :, 0])
    assert torch.equal(ours_c[:, :, 1], alone[1].view(ours.shape[0], 3, 2, -1)[:, :, 0])
    assert half and seconds == 1.0


def video_prompt(grids, seed=0):
    """input_ids [1, n]: text, an image, text, each video of ``grids`` between
    <start>/<end>, text; the patches (random) of the image and of the videos."""
    ids, image_pixels, image_grids = image_prompt([(1, 2, 4)], seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    ids = ids[0].tolist()
    for t, h, w in grids:
        ids += [302] + [VIDEO] * (t * h * w // 4) + [303]
        ids += torch.randint(0, 290, (3,), generator=generator).tolist()
    patches = sum(t * h * w for t, h, w in grids)
    videos = torch.randn(patches, 3 * 2 * 4 * 4, generator=generator)
    return torch.tensor([ids]), image_pixels, image_grids, videos, torch.tensor(grids)


def test_video_positions_and_logits_are_transformers(gloo_group, vl_folder):
    """An image and two videos (3 and 2 temporal patches; 1.25 and 0.5 seconds each, so
    the temporal rows step 5 and 2 at tokens_per_second 4): positions equal
    get_rope_index's, logits within 1e-4 of Qwen2_5_VLForConditionalGeneration's."""
    from swift_mcore.models import vision

    model, _, vl = load_ours(vl_folder)
    hf = transformers_model(vl_folder)
    ids, pixels, grids, videos, video_grids = video_prompt([(3, 4, 2), (2, 2, 6)])
    seconds = torch.tensor([1.25, 0.5])
    kinds = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    theirs, _ = hf.model.get_rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=grids,
                                        video_grid_thw=video_grids,
                                        second_per_grid_ts=seconds)
    ours = vision.rope_index(ids, grids, vl, None, video_grids, seconds)
    assert torch.equal(ours, theirs)
    # the seconds matter: 1 s per temporal patch (transformers' default) gives others
    assert not torch.equal(ours, vision.rope_index(ids, grids, vl, None, video_grids))
    # packed after it, a sample's positions (its video's too) are those it has alone
    second, _, grids2, _, videos2 = video_prompt([(2, 2, 2)], seed=5)
    n1, n2 = ids.shape[1], second.shape[1]
    packed = vision.rope_index(torch.cat([ids, second], 1), torch.cat([grids, grids2]), vl,
                               torch.cat([torch.arange(n1), torch.arange(n2)])[None],
                               torch.cat([video_grids, videos2]),
                               torch.cat([seconds, torch.tensor([0.75])]))
    assert torch.equal(packed[:, :, :n1], ours)
    assert torch.equal(packed[:, :, n1:], vision.rope_index(second, grids2, vl, None, videos2,
                                                            torch.tensor([0.75])))
    inputs = dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
                  pixel_values_videos=videos, video_grid_thw=video_grids,
                  second_per_grid_ts=seconds)
    with torch.no_grad():
        expected = hf(**inputs, mm_token_type_ids=kinds).logits
        got = model(position_ids=None, attention_mask=None, **inputs)[..., :320]
        other = model(position_ids=None, attention_mask=None,
                      **dict(inputs, pixel_values_videos=videos.flip(0)))[..., :320]
    assert (got - expected).abs().max() <= 1e-4
    assert (other - expected).abs().max() > 1e-2  # the videos are in the model
    # export's --test_convert_precision feeds a video too
    tokens = torch.randint(0, 290, (2, 64), generator=torch.Generator().manual_seed(0))
    assert "pixel_values_videos" in vision.precision_inputs(vl, tokens, torch.Generator())
    ours, theirs = vision.compare_logits(model, str(vl_folder), vl, tokens, 320,
                                         torch.Generator().manual_seed(0))
    assert (ours - theirs).abs().max() <= 1e-4


# ---- video rows (data/multimodal.py) ------------------------------------------------------

SMALL_FLAGS = ["--video_min_pixels", "64", "--video_max_pixels", "256"]


def video_encoder(folder, **extra):
    from transformers import AutoImageProcessor

    from swift_mcore.data.multimodal import ImageEncoder

    encoder = encoder_for(folder)
    return ImageEncoder(encoder.template, AutoImageProcessor.from_pretrained(str(folder)),
                        sampling=sampling(**extra))


def test_video_rows_encode_as_the_chat_template_writes_them(vl_folder, tmp_path):
    """A <video> tag with a video file, the same as a content-list video item, and its
    frames as a list of images: one encoding (pads expanded to t * h * w / 4 video pads
    between vision_start/end, as the processor writes them), one set of patches."""
    from PIL import Image
    from transformers import AutoTokenizer

    from swift_mcore.data.multimodal import read_image_row

    frames = coloured(4)
    video = write_video(tmp_path / "clip.mkv", frames, fps=4)
    paths = []
    for i, frame in enumerate(frames):
        paths.append(str(tmp_path / f"f{i}.png"))
        Image.fromarray(frame).save(paths[-1])
    image = write_image(tmp_path / "img.png", 8, 8)
    answer = {"role": "assistant", "content": "def add(a, b)"}
    rows = [{"messages": [{"role": "user", "content": "<image>and<video> what?"}, answer],
             "images": [image], "videos": [video]},
            {"messages": [{"role": "user", "content": [
                {"type": "image", "image": image}, {"type": "text", "text": "and"},
                {"type": "video", "video": video}, {"type": "text", "text": " what?"}]},
                answer]},
            {"messages": [{"role": "user", "content": "<image>and<video> what?"}, answer],
             "images": [image], "videos": [paths]}]
    encoder = video_encoder(vl_folder, fps=4)
    encoded = [encoder.encode(read_image_row(row, f"row {i}")) for i, row in enumerate(rows)]
    first = encoded[0]
    assert first.video_grid_thw.tolist() == [[2, 4, 6]]  # 4 frames of 16 x 24
    assert first.second_per_grid_ts.tolist() == [0.5]
    for other in encoded[1:]:
        assert other.ids.tolist() == first.ids.tolist()
        assert torch.equal(other.pixel_values_videos, first.pixel_values_videos)
        assert other.second_per_grid_ts.tolist() == [0.5]
    tokenizer = AutoTokenizer.from_pretrained(str(vl_folder))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>and"
          "<|vision_start|>" + "<|video_pad|>" * 12 + "<|vision_end|> what?"}, answer],
        tokenize=False)
    assert first.ids.tolist() == tokenizer.encode(text, add_special_tokens=False)
    assert not np.isin(first.ids[first.targets], [IMAGE, VIDEO]).any()
    assert first.media_tokens(2) == 1 + 12


def _bad_video_rows(tmp_path):
    import os

    video = write_video(tmp_path / "ok.mkv", coloured(4))
    (tmp_path / "notes.mp4").write_text("not a video")
    os.mkfifo(tmp_path / "pipe.mp4")
    empty = tmp_path / "empty.avi"  # a header and a video stream, no frames
    import av

    with av.open(str(empty), "w") as container:
        stream = container.add_stream("ffv1", rate=4)
        stream.width, stream.height, stream.pix_fmt = 8, 8, "bgr0"
        container.start_encoding()
    truncated = tmp_path / "cut.mkv"  # Matroska without any frame is no container at all
    truncated.write_bytes(open(video, "rb").read()[:40])
    frame = write_image(tmp_path / "frame.png", 8, 8)
    user = lambda content: [{"role": "user", "content": content},  # noqa: E731
                            {"role": "assistant", "content": "ok"}]
    gone = str(tmp_path / "gone.mp4")
    return [
        ({"messages": user("<video>hi"), "videos": [gone]},
         f"row 7: videos\\[0\\] {gone}: cannot be read \\(No such file"),
        ({"messages": user("<video>hi"), "videos": [str(tmp_path / "notes.mp4")]},
         r"row 7: videos\[0\] .*notes.mp4: not a video PyAV can read"),
        ({"messages": user("<video>hi"), "videos": [str(tmp_path / "pipe.mp4")]},
         r"row 7: videos\[0\] .*pipe.mp4: is a FIFO"),
        ({"messages": user("<video>hi"), "videos": [str(empty)]},
         r"row 7: videos\[0\] .*empty.avi: a video of no frames"),
        ({"messages": user("<video>hi"), "videos": [str(truncated)]},
         r"row 7: videos\[0\] .*cut.mkv: not a video PyAV can read"),
        ({"messages": user("<video><video>hi"), "videos": [video]},
         r"row 7: 2 <video> tag\(s\) in the messages but 1 video\(s\) in 'videos'"),
        ({"messages": user("hi"), "videos": [video]},
         r"row 7: 0 <video> tag\(s\) in the messages but 1 video\(s\)"),
        ({"messages": user("<video>hi"), "videos": ["https://x.org/a.mp4"]},
         r"row 7: videos\[0\]: https://x.org/a.mp4 is a URL"),
        ({"messages": user([{"type": "video", "video": "http://x.org/a.mp4"}])},
         r"row 7: messages\[0\].content\[0\]: http://x.org/a.mp4 is a URL"),
        ({"messages": user("<video>hi"), "videos": [[frame, str(tmp_path / "f9.png")]]},
         r"row 7: videos\[0\]\[1\] .*f9.png: cannot be read"),
        ({"messages": user("<video>hi"), "videos": [[]]},
         r"row 7: videos\[0\]: an empty list of frames"),
        ({"messages": [{"role": "user", "content": "hi"},
                       {"role": "assistant", "content": "<video>"}], "videos": [video]},
         r"row 7: messages\[1\] \(assistant\) holds <video>"),
    ]


def test_bad_video_rows_are_named_before_any_work(vl_folder, tmp_path, monkeypatch):
    from swift_mcore import input_files
    from swift_mcore.data.conversations import _refuse_media
    from swift_mcore.data.multimodal import read_image_row
    from swift_mcore.errors import ArgumentError

    for row, message in _bad_video_rows(tmp_path):
        with pytest.raises(ArgumentError, match=message):
            read_image_row(row, "row 7")
    # the bounds, checked before any frame is decoded (lowered here to this 4-frame video)
    row = {"messages": [{"role": "user", "content": "<video>hi"},
                        {"role": "assistant", "content": "ok"}],
           "videos": [str(tmp_path / "ok.mkv")]}
    for name, value, message in (
            ("MAX_VIDEO_FRAMES", 3, r"ok.mkv: more than 3 frames \(cut it shorter\)"),
            ("MAX_VIDEO_BYTES", 100, r"ok.mkv: \d+ bytes, more than a video may have"),
            ("MAX_IMAGE_PIXELS", 100, r"ok.mkv: frames of 24x16 pixels, more than 100")):
        with monkeypatch.context() as patch:
            patch.setattr(input_files, name, value)
            with pytest.raises(ArgumentError, match=r"row 7: videos\[0\] .*" + message):
                read_image_row(row, "row 7")
    read_image_row(row, "row 7")
    frames = {**row, "videos": [[write_image(tmp_path / f"f{i}.png", 8, 8) for i in range(4)]]}
    with monkeypatch.context() as patch:  # a frame list: counted before any frame is read
        patch.setattr(input_files, "MAX_VIDEO_FRAMES", 3)
        with pytest.raises(ArgumentError, match=r"row 7: videos\[0\]: a list of 4 frames, "
                                                r"more than 3 \(cut it shorter\)"):
            read_image_row(frames, "row 7")
    read_image_row(frames, "row 7")
    video = write_video(tmp_path / "two.mkv", coloured(2))
    row = {"messages": [{"role": "user", "content": "<video>hi"},
                        {"role": "assistant", "content": "ok"}], "videos": [video]}
    with pytest.raises(ArgumentError, match="row 7: column 'videos' holds videos .*a text model .*"
                       r"give --model a vision-language model"):
        _refuse_media(row, "row 7")  # a text model's sft
    # a video too short for one temporal patch, once sampled
    one = write_video(tmp_path / "one.mkv", coloured(1))
    row["videos"] = [one]
    with pytest.raises(ArgumentError, match=r"row 7: videos\[0\] .*one.mkv: 1 frame\(s\) at 4 "
                                            r"fps give 0 sampled frames; a video needs at "
                                            r"least 2"):
        video_encoder(vl_folder).encode(read_image_row(row, "row 7"))


# ---- sft and infer with videos ------------------------------------------------------------

def video_dataset(tmp_path, rows=8, size=16):
    """rows conversations: even ones a video file, odd ones an image and a frame list."""
    from PIL import Image

    lines = []
    for i in range(rows):
        frames = [np.roll(f, i, axis=1) for f in coloured(4, size, size)]
        answer = {"role": "assistant", "content": f"def add(a, b): {i % 3}"}
        if i % 2 == 0:
            video = write_video(tmp_path / f"v{i}.mkv", frames)
            lines.append({"messages": [{"role": "user", "content": f"<video>what is {i}?"},
                                       answer], "videos": [video]})
        else:
            paths = []
            for j, frame in enumerate(frames[:3]):
                paths.append(str(tmp_path / f"v{i}_{j}.png"))
                Image.fromarray(frame).save(paths[-1])
            image = write_image(tmp_path / f"i{i}.png", size, size, seed=i)
            lines.append({"messages": [{"role": "user", "content": f"<image><video>is {i}?"},
                                       answer], "images": [image], "videos": [paths]})
    data = tmp_path / "videos.jsonl"
    data.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return data


def test_sft_with_videos_trains(tmp_path, train_here, vl_folder, monkeypatch, capsys):
    """sft on video rows (files and frame lists, with images; stored in the token cache):
    finite losses that fall over four steps; `preprocess sft` writes the rows and `sft
    --cached_dataset` trains loss for loss as the raw files; a row whose video patches
    pass --seq_length is named before work."""
    from run_helpers import losses
    from test_hf_training import run_flags

    from swift_mcore import preprocess
    from swift_mcore.errors import ArgumentError

    monkeypatch.setenv("SWIFT_MCORE_CACHE", str(tmp_path / "cache"))
    data = video_dataset(tmp_path)
    assert preprocess.main(["sft", "--model", str(vl_folder), "--dataset", str(data),
                            "--template", "tokenizer", "--output_dir",
                            str(tmp_path / "prepared"), *SMALL_FLAGS]) == 0
    out = capsys.readouterr().out
    assert "4 images and 8 videos, read from their files at training" in out
    assert "--video_min_pixels 64 --video_max_pixels 256" in out
    flags = ["--model", vl_folder, "--dataset", data, "--lr", "1e-2", "--min_lr", "1e-2",
             "--template", "tokenizer", "--no_save", *SMALL_FLAGS]
    train_here(tmp_path / "out", *flags, "--seq_length", "64", "--train_iters", "4",
               base=run_flags())
    first = losses(tmp_path / "out")
    assert sorted(first) == [1, 2, 3, 4] and all(np.isfinite(list(first.values())))
    assert first[4] < first[1]
    train_here(tmp_path / "cached", *flags[:2], "--cached_dataset", tmp_path / "prepared",
               *flags[4:], "--seq_length", "64", "--train_iters", "4", base=run_flags())
    assert losses(tmp_path / "cached") == first
    # another video flag than the folder's is named
    with pytest.raises(ArgumentError, match=r"--cached_dataset .*prepared: was prepared with "
                                            r"the video flags \(--fps"):
        train_here(tmp_path / "other", *flags[:2], "--cached_dataset", tmp_path / "prepared",
                   *flags[4:], "--fps", "1", "--seq_length", "64", "--train_iters", "1",
                   base=run_flags())
    # a video file changed since: the folder is refused at start, naming it
    write_video(tmp_path / "v2.mkv", coloured(6, 16, 16))
    with pytest.raises(ArgumentError, match=r"--cached_dataset .*prepared: its video .*v2.mkv "
                                            r"changed since it was stored .*the images and "
                                            r"videos must stay where they were"):
        train_here(tmp_path / "stale", *flags[:2], "--cached_dataset", tmp_path / "prepared",
                   *flags[4:], "--seq_length", "64", "--train_iters", "1", base=run_flags())
    # 16x16 frames: 2 temporal patches of 4 merged patches, 8 pads; 48x48 ones: 72 pads
    big = video_dataset(tmp_path / "big" if (tmp_path / "big").mkdir() is None else None,
                        rows=1, size=48)
    with pytest.raises(ArgumentError, match=r"videos.jsonl, row 0: \d+ tokens \(72 of them "
                                            r"its images' and videos'\), more than "
                                            r"--seq_length 64"):
        train_here(tmp_path / "big_out", *flags[:3], big, *flags[4:], "--video_max_pixels",
                   "4096", "--seq_length", "64", "--train_iters", "1", base=run_flags())
    assert not (tmp_path / "big_out" / "checkpoint").exists()


@pytest.mark.benchmark
def test_sft_with_videos_resumes_exactly(tmp_path, train_here, vl_folder):
    """Resumed from step 2, steps 3 and 4 log what the straight run logged (the videos are
    decoded again per sample, deterministically; images' resume is in the suite)."""
    from run_helpers import losses
    from test_hf_training import run_flags

    flags = ["--model", vl_folder, "--dataset", video_dataset(tmp_path), "--lr", "1e-2",
             "--min_lr", "1e-2", "--template", "tokenizer", "--seq_length", "64",
             "--train_iters", "4", *SMALL_FLAGS]
    train_here(tmp_path / "out", *flags, "--save_steps", "2", base=run_flags())
    train_here(tmp_path / "resumed", *flags, "--no_save", "--resume",
               tmp_path / "out" / "checkpoint" / "iter_0000002", base=run_flags())
    first = losses(tmp_path / "out")
    assert losses(tmp_path / "resumed") == {3: first[3], 4: first[4]}


def test_infer_with_a_video_gives_transformers_greedy_tokens(gloo_group, vl_folder, tmp_path):
    from transformers import AutoTokenizer

    from swift_mcore.arguments.infer import InferArguments
    from swift_mcore.data.video import patches, read_video_file
    from swift_mcore.infer import run

    video = write_video(tmp_path / "clip.mkv", coloured(6, 16, 16), fps=4)
    answer = run(InferArguments(model=str(vl_folder), prompt="what is it?", video=video,
                                template="tokenizer", max_new_tokens=5, video_min_pixels=64,
                                video_max_pixels=256).validate())
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(str(vl_folder))
    # 6 frames at 4 fps, 2 per second: 3 frames, raised to 4 (--fps_min_frames) taken at
    # 4 / 6 x 4 fps: 0.75 s per temporal patch of 2 frames
    frames = read_video_file(video, "v", sampling(video_max_pixels=256), 8, 2,
                             processor.resample)
    pixels, grid, seconds = patches(frames, processor)
    assert (grid, seconds) == ((2, 4, 4), pytest.approx(0.75))
    tokenizer = AutoTokenizer.from_pretrained(str(vl_folder))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "<|vision_start|>" + "<|video_pad|>" * 8
          + "<|vision_end|>what is it?"}], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    hf = transformers_model(vl_folder)
    new = []
    with torch.no_grad():
        for _ in range(5):
            logits = hf(input_ids=ids, mm_token_type_ids=2 * (ids == VIDEO).int(),
                        pixel_values_videos=pixels, video_grid_thw=torch.tensor([grid]),
                        second_per_grid_ts=torch.tensor([seconds])).logits[0, -1, :306]
            new.append(int(logits.argmax()))
            ids = torch.cat([ids, torch.tensor([[new[-1]]])], dim=1)
    expected = tokenizer.decode([t for t in new if t != tokenizer.eos_token_id])
    assert answer and answer == expected.split("<|im_end|>")[0], (answer, expected)
    from swift_mcore.errors import ArgumentError

    with pytest.raises(ArgumentError, match="--image and --video: give one"):
        InferArguments(model=str(vl_folder), prompt="hi", image=video, video=video,
                       template="tokenizer").validate()
    with pytest.raises(ArgumentError, match=r"--video .*gone.mp4: cannot be read"):
        run(InferArguments(model=str(vl_folder), prompt="hi", video=str(tmp_path / "gone.mp4"),
                           template="tokenizer").validate())


# ---- Qwen3-VL -----------------------------------------------------------------------------

def test_qwen3_vl_video_positions_and_logits_are_transformers(gloo_group, vl3_folder):
    """Qwen3-VL: a video's frame groups are parted by timestamp text, each group its own
    1 x h x w grid; positions equal get_rope_index's and logits (deepstack features at
    the image and video pads together) within 1e-4 of transformers'."""
    from test_qwen3_vl import transformers_model as hf3

    from swift_mcore.loaded_model import load_model
    from swift_mcore.models import vision

    model = load_model(str(vl3_folder), log=lambda line: None).model.eval()
    vl, hf = model.vl, hf3(vl3_folder)
    generator = torch.Generator().manual_seed(3)
    text = lambda n: torch.randint(0, 290, (n,), generator=generator).tolist()  # noqa: E731
    image_ids, pixels, grids = image_prompt([(1, 2, 4)], seed=3)
    ids = image_ids[0].tolist()
    video_grids = torch.tensor([[3, 4, 2], [2, 2, 6]])
    for t, h, w in video_grids.tolist():
        for _ in range(t):  # "<0.5 seconds>" then the group's pads
            ids += text(4) + [302] + [VIDEO] * (h * w // 4) + [303]
        ids += text(2)
    ids = torch.tensor([ids])
    videos = torch.randn(int(video_grids.prod(-1).sum()), 3 * 2 * 4 * 4, generator=generator)
    kinds = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    theirs, _ = hf.model.get_rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=grids,
                                        video_grid_thw=video_grids)
    assert torch.equal(vision.rope_index(ids, grids, vl, None, video_grids), theirs)
    inputs = dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
                  pixel_values_videos=videos, video_grid_thw=video_grids)
    with torch.no_grad():
        expected = hf(**inputs, mm_token_type_ids=kinds).logits
        got = model(position_ids=None, attention_mask=None, **inputs)[..., :320]
        alone = model(position_ids=None, attention_mask=None,
                      **dict(inputs, pixel_values=None, image_grid_thw=None,
                             input_ids=torch.where(ids == IMAGE, 0, ids)))[..., :320]
        theirs_alone = hf(**dict(inputs, pixel_values=None, image_grid_thw=None,
                                 input_ids=torch.where(ids == IMAGE, 0, ids)),
                          mm_token_type_ids=2 * (ids == VIDEO).int()).logits
    assert (got - expected).abs().max() <= 1e-4
    assert (alone - theirs_alone).abs().max() <= 1e-4
    # a row with a video, encoded as Qwen3-VL's processor writes it: "<T seconds>" before
    # each frame group's pads; the sample gives transformers' logits
    from types import SimpleNamespace

    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    from swift_mcore.data.multimodal import ImageEncoder, read_image_row

    frames = coloured(10, 16, 16)
    video = write_video(vl3_folder.parent / "clip.mkv", frames, fps=4)
    row = {"messages": [{"role": "user", "content": "<video> what?"},
                        {"role": "assistant", "content": "ok"}], "videos": [video]}
    encoder = ImageEncoder(encoder_for(vl3_folder).template,
                           AutoImageProcessor.from_pretrained(str(vl3_folder)),
                           sampling=sampling(), timestamps=True)
    sample = encoder.encode(read_image_row(row, "row 0"))
    assert sample.video_grid_thw.tolist() == [[2, 4, 4]]  # frames 0, 3, 6, 9 of 16 x 16
    processor = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
        vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
        video_token="<|video_pad|>",
        _calculate_timestamps=lambda *a: Qwen3VLProcessor._calculate_timestamps(None, *a))
    shown = Qwen3VLProcessor.replace_video_token(processor, {
        "video_grid_thw": sample.video_grid_thw,
        "video_metadata": [VideoMetadata(total_num_frames=10, fps=4.0,
                                         frames_indices=[0, 3, 6, 9])]}, 0)
    assert shown.startswith("<0.4 seconds><|vision_start|><|video_pad|>")  # (0 + 3) / 2 / 4
    tokenizer = AutoTokenizer.from_pretrained(str(vl3_folder))
    text = tokenizer.apply_chat_template([{"role": "user", "content": shown + " what?"},
                                          row["messages"][1]], tokenize=False)
    assert sample.ids.tolist() == tokenizer.encode(text, add_special_tokens=False)
    ids = torch.from_numpy(sample.ids).long()[None]
    inputs = dict(input_ids=ids, pixel_values_videos=sample.pixel_values_videos,
                  video_grid_thw=sample.video_grid_thw)
    with torch.no_grad():
        expected = hf(**inputs, mm_token_type_ids=2 * (ids == VIDEO).int()).logits
        got = model(position_ids=None, attention_mask=None, **inputs)[..., :320]
    assert (got - expected).abs().max() <= 1e-4
