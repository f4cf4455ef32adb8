"""Image and video rows in the token cache (data/image_cache.py): encoded once (the tokens,
patches, grids and seconds per temporal patch of encoding them in memory), reused without
tokenizing or decoding again, never served stale for a changed image or video file, image
processor or video flag, refused or rebuilt when tampered with; `preprocess sft` writes
them for `sft --cached_dataset`, which trains as the raw-file run does (videos':
test_qwen2_5_vl_video.py::test_sft_with_videos_trains)."""

import base64
import json
import os

import numpy as np
import pytest
import torch

from swift_mcore.errors import ArgumentError
from test_qwen2_5_vl import image_dataset, vl_folder, write_image  # noqa: F401  (fixture)
from test_qwen2_5_vl_video import SMALL, coloured, video_dataset, video_encoder, write_video


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("SWIFT_MCORE_CACHE", str(path))
    return path


def sft_config(folder, **flags):
    from swift_mcore.arguments import SftArguments
    from swift_mcore.run_config import resolve

    flags.setdefault("seq_length", 64)
    return resolve(SftArguments.from_flags(model=str(folder), template="tokenizer", **flags),
                   world_size=1, cuda=False)


def build(config):
    from swift_mcore.data.image_sft import build_image_sft_datasets
    from swift_mcore.data.tokenizer import build_tokenizer

    events, logs = [], []
    train, valid, _ = build_image_sft_datasets(config, build_tokenizer(config),
                                               log=logs.append, on_cache=events.append)
    return train, valid, events


def rows_of(dataset):
    """Every row's tensors, as its collated batch of one gives them."""
    out = []
    for r in range(len(dataset)):
        batch = dataset.collate([dataset[r]])
        out.append({k: v.tolist() for k, v in batch.items()})
    return out


def mixed_rows(tmp_path):
    """Image rows: two images in one row, a base64 image, a row of text alone."""
    rows = [json.loads(line) for line in image_dataset(tmp_path, rows=3).read_text().split("\n")
            if line]
    wide = write_image(tmp_path / "wide.png", 30, 14, seed=7)
    tall = write_image(tmp_path / "tall.png", 9, 26, seed=8)
    rows.append({"messages": [{"role": "user", "content": "<image>add<image> them"},
                              {"role": "assistant", "content": "def add(a, b)"}],
                 "images": [wide, "data:image/png;base64," + base64.b64encode(
                     open(tall, "rb").read()).decode()]})
    rows.append({"messages": [{"role": "user", "content": "no image"},
                              {"role": "assistant", "content": "def f(): 1"}]})
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data, rows


def in_memory(folder, rows, **processor):
    """Each row encoded as the pre-cache path did: read, checked and encoded in memory."""
    from transformers import AutoImageProcessor

    from swift_mcore.data.multimodal import ImageEncoder, read_image_row
    from swift_mcore.data.templates import Template
    from swift_mcore.data.tokenizer import load_tokenizer

    encoder = ImageEncoder(Template("tokenizer", load_tokenizer(str(folder))),
                           AutoImageProcessor.from_pretrained(str(folder), **processor))
    return [encoder.encode(read_image_row(row, f"row {i}")) for i, row in enumerate(rows)]


def assert_rows_equal_in_memory(dataset, expected):
    assert len(dataset) == len(expected)
    for r, want in enumerate(expected):
        item = dataset[r]
        ids, targets = want.ids.astype(np.int64), want.targets
        assert item["tokens"].tolist() == ids[:-1].tolist()
        assert item["labels"].tolist() == ids[1:].tolist()
        assert item["loss_mask"].tolist() == targets[1:].tolist()
        if want.pixel_values is None:
            assert item["pixels"] is None
        else:
            assert torch.equal(item["pixels"][0], want.pixel_values)
            assert torch.equal(item["pixels"][1], want.image_grid_thw)


def test_image_rows_are_encoded_once_as_in_memory_and_reused(cache, tmp_path, vl_folder,
                                                              monkeypatch):
    from swift_mcore.data import multimodal, templates

    data, rows = mixed_rows(tmp_path)
    train, _, events = build(sft_config(vl_folder, dataset=[str(data)]))
    assert events == ["built"]
    assert_rows_equal_in_memory(train, in_memory(vl_folder, rows))
    first = rows_of(train)

    # A second start reads the stored tokens: nothing is tokenized or encoded again.
    def refuse(*args, **kwargs):
        raise AssertionError("tokenized again")

    with monkeypatch.context() as patched:
        patched.setattr(templates.Template, "encode_many", refuse)
        patched.setattr(multimodal.ImageEncoder, "encode", refuse)
        again, _, events = build(sft_config(vl_folder, dataset=[str(data)]))
        assert events == ["reused"] and rows_of(again) == first
        packed, _, events = build(sft_config(vl_folder, dataset=[str(data)], packing=True,
                                             seq_length=160))
        assert events == ["reused", "packing built"]
        _, valid, events = build(sft_config(vl_folder, dataset=[str(data)],
                                            val_dataset=[str(data)]))
        assert events == ["reused", "reused"] and rows_of(valid) == first
    # packing lays the same rows end to end, their images' patches in row order
    assert len(packed) < len(train)
    assert sum(len(r["tokens"][0]) for r in rows_of(packed)) == sum(
        len(r["tokens"][0]) for r in first)
    # Worker processes encode the same arrays (in chunks of IMAGE_CHUNK rows).
    import shutil

    from swift_mcore.data import image_cache

    monkeypatch.setattr(image_cache, "IMAGE_CHUNK", 2)
    shutil.rmtree(cache / "sft-images")
    two, _, events = build(sft_config(vl_folder, dataset=[str(data)], dataset_num_proc=2))
    assert events == ["built"] and rows_of(two) == first
    # Another --max_pixels is another image processor: encoded anew, with its grids.
    smaller, _, events = build(sft_config(vl_folder, dataset=[str(data)], max_pixels=256))
    assert events == ["built"]
    assert_rows_equal_in_memory(smaller, in_memory(vl_folder, rows, max_pixels=256))
    assert rows_of(smaller) != first


def test_the_key_holds_every_setting_of_the_image_processor(vl_folder):
    """Means, stds, patch and merge sizes of the folder's preprocessor_config.json, and
    --max_pixels / --min_pixels, each name another cache folder."""
    from transformers import AutoImageProcessor

    from swift_mcore.data.image_cache import processor_identity

    def identity(**changed):
        return processor_identity(AutoImageProcessor.from_pretrained(str(vl_folder),
                                                                     **changed))

    base = identity()
    assert identity() == base
    for changed in ({"image_mean": [0.5, 0.5, 0.5]}, {"image_std": [0.2, 0.2, 0.2]},
                    {"patch_size": 2}, {"merge_size": 4}, {"max_pixels": 256},
                    {"min_pixels": 16}):
        assert identity(**changed) != base, changed


def test_a_changed_image_is_never_served_stale(cache, tmp_path, vl_folder, caplog):
    """An image whose bytes change under the same size and mtime is refused when its row is
    loaded; one whose mtime moved is hashed at start and the cache rebuilt for it; one only
    touched keeps the cache."""
    from PIL import Image

    image = str(tmp_path / "a.bmp")  # BMP: other pixels, the same size in bytes
    Image.fromarray(np.full((16, 16, 3), 10, np.uint8)).save(image)
    row = {"messages": [{"role": "user", "content": "<image>what?"},
                        {"role": "assistant", "content": "def f(): 1"}], "images": [image]}
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(row) + "\n")
    config = sft_config(vl_folder, dataset=[str(data)])
    train, _, events = build(config)
    assert events == ["built"]
    stat = os.stat(image)
    Image.fromarray(np.full((16, 16, 3), 200, np.uint8)).save(image)
    os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.path.getsize(image) == stat.st_size
    with pytest.raises(ArgumentError, match=r"--dataset .*rows.jsonl, row 0: images\[0\] "
                                            r".*a.bmp: changed since its tokens were stored "
                                            r"\(its sha256 differs\); its cached tokens are "
                                            r"discarded: start the run again"):
        train[0]
    train, _, events = build(config)  # the next start encodes it again
    assert events == ["built"]
    assert_rows_equal_in_memory(train, in_memory(vl_folder, [row]))
    Image.fromarray(np.full((16, 16, 3), 90, np.uint8)).save(image)
    os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10 ** 9))
    caplog.clear()
    train, _, events = build(config)
    assert events == ["built"]
    assert "a.bmp changed since it was stored (its sha256 differs); rebuilding it" in caplog.text
    assert_rows_equal_in_memory(train, in_memory(vl_folder, [row]))
    os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2 * 10 ** 9))  # touched only
    assert build(config)[2] == ["reused"]
    os.remove(image)  # gone: rebuilt, and the rebuild names the row
    with pytest.raises(ArgumentError, match=r"rows.jsonl, row 0: images\[0\] .*a.bmp"):
        build(config)


def test_relative_image_paths_are_those_of_the_start_directory(cache, tmp_path, vl_folder,
                                                              monkeypatch):
    """The same rows naming img.png, started from two directories with another img.png
    each: each start encodes its own directory's image."""
    row = {"messages": [{"role": "user", "content": "<image>what?"},
                        {"role": "assistant", "content": "def f(): 1"}], "images": ["img.png"]}
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(row) + "\n")
    config = sft_config(vl_folder, dataset=[str(data)])
    for name, size in (("a", 16), ("b", 32), ("a", 16)):
        (tmp_path / name).mkdir(exist_ok=True)
        write_image(tmp_path / name / "img.png", size, size)
        monkeypatch.chdir(tmp_path / name)
        train, _, events = build(config)
        assert events == ["built"]
        assert_rows_equal_in_memory(train, in_memory(vl_folder, [row]))


def test_a_tampered_image_cache_runs_no_code(cache, tmp_path, vl_folder):
    data = image_dataset(tmp_path, rows=3)
    config = sft_config(vl_folder, dataset=[str(data)])
    first = rows_of(build(config)[0])
    [folder] = [p for p in (cache / "sft-images").iterdir() if not p.name.startswith(".")]
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    for name in ("grids", "ids"):
        path = folder / f"{name}.npy"
        os.chmod(path, 0o644)
        np.save(path, np.array([Payload()], dtype=object), allow_pickle=True)
        train, _, events = build(config)
        assert events == ["built"] and not marker.exists()
        assert rows_of(train) == first
        [folder] = [p for p in (cache / "sft-images").iterdir() if not p.name.startswith(".")]
    # A grid that is not the processor's (not whole merges): rebuilt.
    grids = np.load(folder / "grids.npy")
    grids[0, 1] += 1
    os.chmod(folder / "grids.npy", 0o644)
    np.save(folder / "grids.npy", grids)
    assert build(config)[2] == ["built"]
    # Another image's digest under the same stat: the row is refused at load, not trained.
    [folder] = [p for p in (cache / "sft-images").iterdir() if not p.name.startswith(".")]
    digests = np.load(folder / "digests.npy")
    digests[[0, 1]] = digests[[1, 0]]
    os.chmod(folder / "digests.npy", 0o644)
    np.save(folder / "digests.npy", digests)
    train, _, events = build(config)
    assert events == ["reused"]
    with pytest.raises(ArgumentError, match=r"row 0: images\[0\] .*img0_0.png: changed since"):
        train[0]


def test_preprocess_sft_with_images_trains_as_the_raw_files(cache, tmp_path, vl_folder,
                                                            train_here, capsys):
    from run_helpers import losses
    from test_hf_training import run_flags

    from swift_mcore import preprocess
    from swift_mcore.data.sft_datasets import sft_fingerprint
    from swift_mcore.data.tokenizer import build_tokenizer

    data = image_dataset(tmp_path, rows=6)
    folder = tmp_path / "prepared"
    assert preprocess.main(["sft", "--model", str(vl_folder), "--dataset", str(data),
                            "--template", "tokenizer", "--packing", "true", "--seq_length",
                            "64", "--output_dir", str(folder)]) == 0
    assert "6 images, read from their files at training" in capsys.readouterr().out
    raw_config = sft_config(vl_folder, dataset=[str(data)], packing=True)
    raw = rows_of(build(raw_config)[0])
    prepared_config = sft_config(vl_folder, cached_dataset=str(folder), packing=True)
    prepared, _, events = build(prepared_config)
    assert events == ["packing stored"] and rows_of(prepared) == raw
    tokenizer = build_tokenizer(raw_config)
    assert sft_fingerprint(prepared_config, tokenizer) == sft_fingerprint(raw_config, tokenizer)
    # training from it gives the raw-file run's losses
    flags = ["--model", vl_folder, "--seq_length", "64", "--lr", "1e-2", "--min_lr", "1e-2",
             "--train_iters", "2", "--template", "tokenizer", "--packing", "true",
             "--global_batch_size", "2", "--no_save"]
    train_here(tmp_path / "raw", *flags, "--dataset", data, base=run_flags())
    train_here(tmp_path / "cached", *flags, "--cached_dataset", folder, base=run_flags())
    assert losses(tmp_path / "cached") == losses(tmp_path / "raw")
    assert len(losses(tmp_path / "raw")) == 2
    # another processor setting is named; a changed image refuses the folder
    with pytest.raises(ArgumentError, match=r"--cached_dataset .*prepared: was prepared with "
                                            r"the image processor"):
        build(sft_config(vl_folder, cached_dataset=str(folder), max_pixels=256))
    write_image(tmp_path / "img0_2.png", 16, 16, seed=99)
    with pytest.raises(ArgumentError, match=r"--cached_dataset .*prepared: its image "
                                            r".*img0_2.png changed since it was stored .*"
                                            r"the images and videos must stay where they "
                                            r"were"):
        build(prepared_config)
    os.remove(folder / "grids.npy")
    with pytest.raises(ArgumentError, match=r"--cached_dataset .*prepared: not a dataset of "
                                            r"image rows written by `swift-mcore preprocess "
                                            r"sft` \(grids.npy: .*cannot be read"):
        build(prepared_config)


# ---- video rows ----------------------------------------------------------------------------

VIDEO_FLAGS = {k: SMALL[k] for k in ("video_min_pixels", "video_total_pixels")}
VIDEO_FLAGS["video_max_pixels"] = 256


def config_for(folder, data, **flags):
    return sft_config(folder, dataset=[str(data)], **{**VIDEO_FLAGS, **flags})


def video_in_memory(folder, data, **sampling):
    from swift_mcore.data.multimodal import read_image_row

    encoder = video_encoder(folder, **{**VIDEO_FLAGS, **sampling})
    return [encoder.encode(read_image_row(json.loads(line), f"row {i}"))
            for i, line in enumerate(data.read_text().splitlines())]


def assert_video_rows_equal(dataset, expected):
    assert len(dataset) == len(expected)
    for r, want in enumerate(expected):
        item = dataset[r]
        ids = want.ids.astype(np.int64)
        assert item["tokens"].tolist() == ids[:-1].tolist()
        assert item["loss_mask"].tolist() == want.targets[1:].tolist()
        for got, tensors in ((item["pixels"], (want.pixel_values, want.image_grid_thw)),
                             (item["videos"], (want.pixel_values_videos, want.video_grid_thw,
                                               want.second_per_grid_ts))):
            if tensors[0] is None:
                assert got is None
            else:
                assert len(got) == len(tensors)
                assert all(torch.equal(g, w) for g, w in zip(got, tensors)), r


def test_video_rows_are_encoded_once_as_in_memory_and_reused(cache, tmp_path, vl_folder,
                                                              monkeypatch):
    """Video files and frame lists (with an image) stored as in-memory encoding gives them;
    a second start decodes nothing; another --fps (a frame list's rate: other seconds per
    temporal patch) or --video_max_pixels (smaller frames) is encoded anew;
    a video file whose bytes changed (its mtime moved) is hashed at start and rebuilt."""
    from swift_mcore.data import multimodal, templates

    data = video_dataset(tmp_path, rows=4)
    train, _, events = build(config_for(vl_folder, data))
    assert events == ["built"]
    assert_video_rows_equal(train, video_in_memory(vl_folder, data))
    first = rows_of(train)
    assert "pixel_values_videos" in train.collate([train[0]])

    def refuse(*args, **kwargs):
        raise AssertionError("encoded again")

    with monkeypatch.context() as patched:
        patched.setattr(templates.Template, "encode_many", refuse)
        patched.setattr(multimodal.ImageEncoder, "encode", refuse)
        again, _, events = build(config_for(vl_folder, data))
        assert events == ["reused"] and rows_of(again) == first
    for flags in ({"fps": 1.0}, {"video_max_pixels": 64}):
        other, _, events = build(config_for(vl_folder, data, **flags))
        assert events == ["built"], flags
        assert_video_rows_equal(other, video_in_memory(vl_folder, data, **flags))
        assert rows_of(other) != first
    # row 0's video file rewritten with other frames (and another mtime): rebuilt for it
    frames = [np.roll(f, 3, axis=0) for f in coloured(6, 16, 16)]
    write_video(tmp_path / "v0.mkv", frames)
    train, _, events = build(config_for(vl_folder, data))
    assert events == ["built"]
    assert_video_rows_equal(train, video_in_memory(vl_folder, data))
    assert rows_of(train) != first


def frame_list_rows(tmp_path):
    """One row whose video is a list of two BMP frames (a changed BMP keeps its size)."""
    from PIL import Image

    paths = []
    for j in range(2):
        paths.append(str(tmp_path / f"f{j}.bmp"))
        Image.fromarray(np.full((16, 16, 3), 10 + j, np.uint8)).save(paths[-1])
    row = {"messages": [{"role": "user", "content": "<video>what?"},
                        {"role": "assistant", "content": "def f(): 1"}], "videos": [paths]}
    data = tmp_path / "frames.jsonl"
    data.write_text(json.dumps(row) + "\n")
    return data, paths


def test_a_changed_video_is_never_served_stale(cache, tmp_path, vl_folder):
    """A frame whose bytes change under the same size and mtime is refused when its row is
    loaded (hashed before it is decoded), and the next start encodes it again."""
    from PIL import Image

    data, paths = frame_list_rows(tmp_path)
    config = config_for(vl_folder, data)
    train, _, events = build(config)
    assert events == ["built"]
    stat = os.stat(paths[1])
    Image.fromarray(np.full((16, 16, 3), 200, np.uint8)).save(paths[1])
    os.utime(paths[1], ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.path.getsize(paths[1]) == stat.st_size
    with pytest.raises(ArgumentError, match=r"--dataset .*frames.jsonl, row 0: videos\[0\] "
                                            r".*f1.bmp: changed since its tokens were stored "
                                            r"\(its sha256 differs\); its cached tokens are "
                                            r"discarded"):
        train[0]
    train, _, events = build(config)
    assert events == ["built"]
    assert_video_rows_equal(train, video_in_memory(vl_folder, data))
    os.remove(paths[0])  # gone: rebuilt, and the rebuild names the row and frame
    with pytest.raises(ArgumentError, match=r"frames.jsonl, row 0: videos\[0\]\[0\] .*f0.bmp"):
        build(config)


def test_a_tampered_video_cache_runs_no_code(cache, tmp_path, vl_folder):
    data = video_dataset(tmp_path, rows=4)
    config = config_for(vl_folder, data)
    first = rows_of(build(config)[0])

    def folder():
        [path] = [p for p in (cache / "sft-images").iterdir() if not p.name.startswith(".")]
        return path

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = folder() / "video_grids.npy"
    os.chmod(path, 0o644)
    np.save(path, np.array([Payload()], dtype=object), allow_pickle=True)
    train, _, events = build(config)
    assert events == ["built"] and not marker.exists() and rows_of(train) == first
    # a stored grid that is not whole merges: rebuilt
    grids = np.load(folder() / "video_grids.npy")
    grids[0, 1] += 1
    os.chmod(folder() / "video_grids.npy", 0o644)
    np.save(folder() / "video_grids.npy", grids)
    assert build(config)[2] == ["built"]
    # another video's digest under the same stat: refused at load, before decoding
    digests = np.load(folder() / "file_digests.npy")
    digests[[0, 1]] = digests[[1, 0]]
    os.chmod(folder() / "file_digests.npy", 0o644)
    np.save(folder() / "file_digests.npy", digests)
    train, _, events = build(config)
    assert events == ["reused"]
    with pytest.raises(ArgumentError, match=r"row 0: videos\[0\] .*v0.mkv: changed since"):
        train[0]
    # a stored grid of whole merges that is not the video's: refused at load
    build(config)
    grids = np.load(folder() / "video_grids.npy")
    grids[0, 0] += 1
    os.chmod(folder() / "video_grids.npy", 0o644)
    np.save(folder() / "video_grids.npy", grids)
    train, _, events = build(config)
    assert events == ["reused"]
    with pytest.raises(ArgumentError, match=r"row 0: the stored tokens do not hold its "
                                            r"videos' pads"):
        train[0]

SHARED = """
import json, sys
from swift_mcore.arguments import SftArguments
from swift_mcore.data.image_sft import build_image_sft_datasets
from swift_mcore.data.tokenizer import build_tokenizer
from swift_mcore.run_config import resolve
config = resolve(SftArguments.from_flags(model=sys.argv[1], dataset=[sys.argv[2]],
                                         seq_length=64, template="tokenizer"),
                 world_size=1, cuda=False)
events = []
train, _, _ = build_image_sft_datasets(config, build_tokenizer(config), log=lambda s: None,
                                       on_cache=events.append)
print(json.dumps({"events": events, "rows": [
    {k: v.tolist() for k, v in train.collate([train[r]]).items()} for r in range(len(train))]}))
"""


@pytest.mark.benchmark  # two interpreters importing transformers: over a minute here
def test_two_processes_share_one_build(cache, tmp_path, vl_folder):
    """Ranks starting together: one encodes the rows while the other waits, then maps them."""
    import subprocess
    import sys
    from pathlib import Path

    data = image_dataset(tmp_path, rows=24)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, "-c", SHARED, str(vl_folder), str(data)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for _ in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(e for r in results for e in r["events"]) == ["built", "reused"]
    assert results[0]["rows"] == results[1]["rows"] and len(results[0]["rows"]) == 24
    assert len([p for p in os.listdir(cache / "sft-images") if not p.startswith(".")]) == 1


# ---- a video file swapped between its hash and its decoding ---------------------------------

def same_size_as(path, data: bytes) -> bytes:
    """``data`` (a video or PNG) padded with zeros to ``path``'s size: both formats' readers
    stop at their end and ignore what follows."""
    size = os.path.getsize(path)
    assert len(data) <= size
    return data + b"\0" * (size - len(data))


def impostors(tmp_path):
    """Row 0's video v0.mkv and row 1's first frame v1_0.png, and for each other valid bytes
    of the same size (other pixels, the same frame size and count)."""
    from PIL import Image

    video = str(tmp_path / "v0.mkv")
    other = write_video(tmp_path / "other.mkv", [255 - f for f in coloured(4, 16, 16)])
    frame = str(tmp_path / "v1_0.png")
    Image.fromarray(np.full((16, 16, 3), 77, np.uint8)).save(tmp_path / "other.png")
    return {video: same_size_as(video, open(other, "rb").read()),
            frame: same_size_as(frame, open(tmp_path / "other.png", "rb").read())}


def swap_before_decoding(monkeypatch, path, data, in_place):
    """The first time the encoder decodes videos (their files hashed already), ``path``
    gets ``data``: renamed over it, or rewritten in place; its size is the same and its
    mtime put back, so that only the bytes differ."""
    from swift_mcore.data.multimodal import ImageEncoder

    decode, done = ImageEncoder.video_patches, []

    def swapped_first(self, videos, where):
        if not done:
            done.append(path)
            st = os.stat(path)
            if in_place:
                with open(path, "r+b") as fh:
                    fh.write(data)
            else:
                with open(f"{path}.new", "wb") as fh:
                    fh.write(data)
                os.replace(f"{path}.new", path)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
            assert (os.path.getsize(path), os.stat(path).st_mtime_ns) == (st.st_size,
                                                                            st.st_mtime_ns)
        return decode(self, videos, where)

    monkeypatch.setattr(ImageEncoder, "video_patches", swapped_first)
    return done


@pytest.mark.parametrize("in_place", [False, True], ids=["renamed-over", "rewritten"])
def test_a_video_swapped_after_its_hash_is_never_decoded(cache, tmp_path, vl_folder,
                                                         monkeypatch, in_place):
    """A row's video file or frame whose bytes change once the load has begun (same size,
    mtime put back) never gives the row its pixels: each file is opened as it is decoded,
    hashed through that handle and refused by its sha256 before any decoding (a rewrite
    during the decoding: test_a_held_video_decodes_across_blocks_as_its_path_does)."""
    data = video_dataset(tmp_path, rows=2)  # row 0: v0.mkv; row 1: an image, 3 frames
    train, _, events = build(config_for(vl_folder, data))
    assert events == ["built"]
    for row, (path, other) in enumerate(impostors(tmp_path).items()):
        done = swap_before_decoding(monkeypatch, path, other, in_place)
        name = ("v0\\.mkv", "v1_0\\.png")[row]
        with pytest.raises(ArgumentError, match=rf"videos\.jsonl, row {row}: videos\[0\] "
                                                rf".*{name}: changed since its tokens were "
                                                rf"stored"):
            train[row]
        assert done == [path] and open(path, "rb").read() == other
    # the files are other bytes now: the next load refuses them, by their sha256
    with pytest.raises(ArgumentError, match=r"row 0: videos\[0\] .*v0\.mkv: changed since its "
                                            r"tokens were stored"):
        train[0]


def test_a_held_video_decodes_across_blocks_as_its_path_does(tmp_path, monkeypatch):
    """A video read through its held handle in 64-byte blocks (each block checked, the
    decoder seeking among them) decodes to the frames reading it by path gives; one
    rewritten in place after its hash stops the decoding with the row's error."""
    from swift_mcore.data import video as V
    from test_qwen2_5_vl_video import sampling

    path = write_video(tmp_path / "clip.mkv", coloured(6, 16, 16))
    monkeypatch.setattr(V, "BLOCK", 64)
    want = V.read_video_file(path, "v", sampling(), 8, 2, 3)
    held = V.HeldVideo(path, "row 3: videos[0] clip.mkv", 1 << 20)
    held.open()  # opened by the caller: decoded twice from the one handle
    try:
        assert len(held.blocks) > 10
        got = V.read_video_file(held, "v", sampling(), 8, 2, 3)
        held.unmoved()
        assert got.indices == want.indices and len(got.images) == len(want.images)
        assert all(np.array_equal(np.asarray(g), np.asarray(w))
                   for g, w in zip(got.images, want.images))
        with open(path, "r+b") as fh:  # a byte in the last block: decoded last
            fh.seek(os.path.getsize(path) - 8)
            fh.write(b"\xff")
        with pytest.raises(ArgumentError, match=r"^row 3: videos\[0\] clip\.mkv: changed "
                                                r"while it was decoded$"):
            V.read_video_file(held, "v", sampling(), 8, 2, 3)
            held.unmoved()
    finally:
        held.close()


def test_a_held_video_read_back_and_forth_reads_each_block_once(tmp_path, monkeypatch):
    """A demuxer going back and forth between two regions of a file (an MP4 whose audio is
    stored after its video: 780 reads of 1 MiB for a 4 MB file before) gets the bytes
    hashed from blocks read and checked once each, not once per visit."""
    from swift_mcore.data import video as V

    data = np.random.default_rng(0).integers(0, 256, 64 * 8, dtype=np.uint8).tobytes()
    path = tmp_path / "apart.mp4"
    path.write_bytes(data)
    monkeypatch.setattr(V, "BLOCK", 64)
    held = V.HeldVideo(str(path), "v", 1 << 20)
    held.open()
    reads = []

    class Counted:
        def __init__(self, file):
            self.file = file

        def read(self, n=-1):
            reads.append(self.file.tell() // 64)
            return self.file.read(n)

        def seek(self, *args):
            return self.file.seek(*args)

    held.file = Counted(held.file)
    try:
        reader = held.reader()
        for _ in range(50):
            for at in (10, 300):
                reader.seek(at)
                assert reader.read(20) == data[at:at + 20]
        assert sorted(reads) == [0, 4]
    finally:
        held.file.file.close()


def test_a_rows_videos_are_open_one_at_a_time(tmp_path, vl_folder, monkeypatch):
    """A row naming one video 40 times (a row of many short clips) is encoded with one video
    file open at a time, not all 40 (under the common limit of 1,024 open files a row of
    1,000 videos failed: 'videos[999] ...: cannot be read (Too many open files)')."""
    from swift_mcore.data import image_cache
    from swift_mcore.data import video as V
    from swift_mcore.data.multimodal import read_image_row

    clip = write_video(tmp_path / "clip.mkv", coloured(2, 16, 16))
    row = {"messages": [{"role": "user", "content": "<video>" * 40 + "what?"},
                        {"role": "assistant", "content": "ok"}], "videos": [clip] * 40}
    item = read_image_row(row, "row 0")
    decode, open_files = V._decoded, []

    def counted(*args, **kwargs):
        open_files.append(len(os.listdir("/proc/self/fd")))
        return decode(*args, **kwargs)

    monkeypatch.setattr(V, "_decoded", counted)
    encoder = video_encoder(vl_folder, **SMALL)
    before = len(os.listdir("/proc/self/fd"))
    ids, _, _, videos = image_cache._encode_row(item, encoder)
    assert len(videos) == 40 and len(open_files) == 40
    assert max(open_files) <= before + 1  # the one being decoded
