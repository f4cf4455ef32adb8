"""Qwen2.5-VL videos (data/video.py, data/multimodal.py, models/vision.py): frames read with
PyAV and sampled by qwen_vl_utils' rule, patches equal to transformers' image processor's
on a still video, 3-D positions and logits equal to transformers' with
pixel_values_videos, rows in both formats, bad videos named before any work, sft and
infer with a video."""

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
    ours, grid, seconds = patches(Frames([Image.fromarray(f) for f in frames], 2.0), processor)
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
