"""Image and video conversations tokenized once: ids with image and video pads expanded,
targets, each image's file, sha256 and patch grid, and each video's files, their sha256, its
grid and seconds per temporal patch (not their pixels, made again from the files when a row
is loaded).

The arrays live in the token cache (array_cache, kind ``sft-images``) keyed like text sft's
samples (the conversation files' content, the tokenizer, the template, --loss_on,
--columns), the image processor's whole configuration (its class, --max_pixels and
--min_pixels, patch and merge sizes, means and stds) and the video flags (--fps, ...,
--video_total_pixels; whether frame groups' times are written): another processor setting
or video flag finds another folder. `swift-mcore preprocess sft` writes the same arrays
into a folder of its own (``write_image_sft_dataset``) that `sft --cached_dataset` reads
(``load_image_sft_dataset``).

Pixel patches are not stored (they are many times the size of the image and video files).
The files are not part of the key either (hashing every file at each start would read them
all); each file's sha256, size and mtime are stored instead, and checked twice:

- at start, every image and video file is stat'ed; one whose size or mtime moved is
  hashed, and if its bytes changed the cached folder is rebuilt (a --cached_dataset folder
  is refused: its conversation files may be gone);
- at load, an image's or video frame's bytes read for the patches are hashed before they
  are decoded (from those bytes), and a video file is hashed (streamed) through the one
  handle it is then probed and decoded from, each block the decoder reads hashed again
  (data/video.py HeldVideo): a file whose bytes changed while its size and mtime stayed is
  refused, naming the row and the image or video, and the cache's folder is set aside so
  that the next start encodes the rows again (a --cached_dataset folder is refused); the
  grids made must be the stored ones. A changed image or video is never trained with the
  tokens of the old one.

Paths are stored absolute. A relative path is resolved from the directory the run starts
in, which the cache then records: started elsewhere, the folder is rebuilt. Images given
inline (base64) are stored as their bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from ..errors import ArgumentError
from ..input_files import MAX_IMAGE_BYTES, open_regular
from .token_cache import IDENTITY_FLAGS, SFT_SCHEMA, _check_sft_arrays, sft_token_identity

logger = logging.getLogger("swift_mcore")

# per sample k: its images are image_offsets[k]:image_offsets[k + 1]; per image i: its
# (t, h, w) patch grid, sha256, (size, mtime_ns), and its path (or inline bytes) in
# refs[ref_offsets[i]:ref_offsets[i + 1]]
IMAGE_SCHEMA = {**SFT_SCHEMA, "image_offsets": ("int64", 1), "grids": ("int64", 2),
                "digests": ("uint8", 2), "stamps": ("int64", 2), "refs": ("uint8", 1),
                "ref_offsets": ("int64", 1), "inline": ("bool", 1),
                # per sample k: its videos are video_offsets[k]:video_offsets[k + 1]; per
                # video v: its (t, h, w) grid, seconds per temporal patch, whether it is a
                # list of frames, and its files file_offsets[v]:file_offsets[v + 1] (one
                # video file, or its frames' images); per file f: its sha256, (size,
                # mtime_ns) and path in file_refs[file_ref_offsets[f]:...[f + 1]]
                "video_offsets": ("int64", 1), "video_grids": ("int64", 2),
                "video_seconds": ("float32", 1), "video_lists": ("bool", 1),
                "file_offsets": ("int64", 1), "file_digests": ("uint8", 2),
                "file_stamps": ("int64", 2), "file_refs": ("uint8", 1),
                "file_ref_offsets": ("int64", 1)}
# Part of the identity: change it whenever what an image row becomes changes.
IMAGE_FORMAT = 3
FLAGS = {**IDENTITY_FLAGS, "images": "swift-mcore's image cache format",
         "image_processor": "the image processor (--max_pixels, --min_pixels, or the "
         "folder's preprocessor_config.json)",
         "videos": "the video flags (--fps, --fps_min_frames, --fps_max_frames, "
         "--video_min_pixels, --video_max_pixels, --video_total_pixels)"}


def processor_identity(processor) -> dict:
    """Everything that decides an image processor's grids: its class and its settings."""
    kind = type(processor)
    return {"class": f"{kind.__module__}.{kind.__qualname__}",
            **json.loads(processor.to_json_string())}


def image_identity(sources_fingerprint: str, encoder, columns) -> dict:
    """What decides the stored arrays: text sft's identity and the image processor's."""
    return {**sft_token_identity(sources_fingerprint, encoder.template.tokenizer,
                                 encoder.template, encoder.loss_on, columns),
            "what": "sft image samples", "images": IMAGE_FORMAT,
            "image_processor": processor_identity(encoder.image_processor),
            "videos": video_identity(encoder)}


def video_identity(encoder) -> dict:
    """What decides a video's frames and tokens besides its files: the sampling flags and
    whether each frame group's time is written (Qwen3-VL)."""
    from dataclasses import asdict

    return {**asdict(encoder.sampling), "timestamps": bool(encoder.timestamps)}


def read_image_bytes(ref: str, where: str) -> Tuple[bytes, Tuple[int, int]]:
    """(bytes, (size, mtime_ns)) of the image at path ``ref`` (read once, bounded), or of
    one given inline as a base64 data URI (mtime 0)."""
    from .multimodal import BASE64_IMAGE, _decoded

    if BASE64_IMAGE.match(ref):
        data = _decoded(ref, where)
        return data, (len(data), 0)
    return read_file_bytes(ref, where)


def read_file_bytes(path: str, where: str) -> Tuple[bytes, Tuple[int, int]]:
    """(bytes, (size, mtime_ns)) of the image file at ``path``, read once, bounded."""
    with open_regular(path, "rb", where) as fh:
        st = os.fstat(fh.fileno())
        data = fh.read(MAX_IMAGE_BYTES + 1)
    if len(data) > MAX_IMAGE_BYTES:
        raise ArgumentError(f"{where}: more than an image may have ({MAX_IMAGE_BYTES >> 20} "
                            f"MiB)")
    return data, (st.st_size, st.st_mtime_ns)


def hashed_file(path: str, where: str, limit: int) -> Tuple[bytes, Tuple[int, int]]:
    """(sha256, (size, mtime_ns)) of the regular file at ``path`` of at most ``limit``
    bytes, read once in chunks (a video is not held in memory to be hashed)."""
    digest = hashlib.sha256()
    with open_regular(path, "rb", where) as fh:
        st = os.fstat(fh.fileno())
        read = 0
        while True:
            chunk = fh.read(1 << 20)
            if not chunk:
                break
            read += len(chunk)
            if read > limit:
                raise ArgumentError(f"{where}: more than {limit >> 20} MiB")
            digest.update(chunk)
    return digest.digest(), (st.st_size, st.st_mtime_ns)


def _file_limit(video) -> int:
    from ..input_files import MAX_VIDEO_BYTES

    return MAX_IMAGE_BYTES if isinstance(video, tuple) else MAX_VIDEO_BYTES


def _held_videos(videos, wheres, stack, check=None) -> list:
    """Per video, its files to be opened once each as it is decoded (one video's at a time,
    whatever the number of videos): a video.HeldVideo (hashed through the handle it is
    decoded from; closed with ``stack`` at the latest), or a tuple of video.HeldFrame (each
    frame's bytes read, hashed and decoded one at a time); ``check(index, digest)`` runs on
    each file's sha256 before it is decoded."""
    from .video import HeldFrame, HeldVideo

    held = []
    for video, at in zip(videos, wheres):
        if isinstance(video, tuple):
            held.append(tuple(HeldFrame(path, None if check is None else
                                        (lambda digest, i=i: check(i, digest)))
                              for i, path in enumerate(video)))
        else:
            one = HeldVideo(video, f"{at} {video}", _file_limit(video),
                            None if check is None else (lambda digest: check(0, digest)))
            stack.callback(one.close)
            held.append(one)
    return held


def _hashed(held) -> list:
    """Per held video (decoded already), per file: (path, sha256, (size, mtime_ns)) of the
    very bytes that were decoded."""
    from .video import HeldVideo

    return [[(video.path, video.digest, video.stamp)] if isinstance(video, HeldVideo)
            else [(f.path, f.digest, f.stamp) for f in video] for video in held]


def picture(data: bytes, where: str):
    """The image in ``data``, upright and RGB (multimodal.upright_rgb)."""
    import io

    from PIL import Image, UnidentifiedImageError

    from .multimodal import upright_rgb

    try:
        with Image.open(io.BytesIO(data)) as image:
            return upright_rgb(image)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise ArgumentError(f"{where}: not an image PIL can read ({e})") from None


# ---- building ----------------------------------------------------------------------------

# Conversations per task sent to a worker: the same chunks whatever the worker count.
IMAGE_CHUNK = 32


def _encode_row(item, encoder):
    """(ids, targets, images, videos) of one row; per image (its path or inline bytes,
    inline?, grid, sha256, (size, mtime_ns), relative path?); per video (a frame list?,
    grid, seconds per temporal patch, per file (absolute path, sha256, (size, mtime_ns),
    relative path?)). Each image and video file is opened once: an image's or frame's bytes
    hashed are the bytes decoded; a video file is hashed through the handle it is decoded
    from, each block read back checked against its hash (video.HeldVideo)."""
    from .multimodal import BASE64_IMAGE

    read = [read_image_bytes(ref, f"{item.where}: images[{i}] {ref:.80}")
            for i, ref in enumerate(item.images)]
    wheres = [f"{item.where}: {f}" for f in item.video_fields]
    with contextlib.ExitStack() as stack:
        held = _held_videos(item.videos, wheres, stack)
        sample = encoder.encode(item, [picture(data, f"{item.where}: images[{i}]")
                                       for i, (data, _) in enumerate(read)], held)
        hashed = _hashed(held)
    videos = []
    if item.videos:
        for video, files, grid, second in zip(item.videos, hashed,
                                              sample.video_grid_thw.tolist(),
                                              sample.second_per_grid_ts.tolist()):
            videos.append((isinstance(video, tuple), grid, second,
                           [(os.path.abspath(p).encode("utf-8", "surrogateescape"), d, st,
                             not os.path.isabs(p)) for p, d, st in files]))
    grids = [] if sample.image_grid_thw is None else sample.image_grid_thw.tolist()
    images = []
    for ref, (data, stamp), grid in zip(item.images, read, grids):
        inline = bool(BASE64_IMAGE.match(ref))
        name = data if inline else os.path.abspath(ref).encode("utf-8", "surrogateescape")
        images.append((name, inline, grid, hashlib.sha256(data).digest(), stamp,
                       not inline and not os.path.isabs(ref)))
    return sample.ids, sample.targets, images, videos


_image_worker: dict = {}


def _init_image_worker(encoder) -> None:
    _image_worker["encoder"] = encoder


def _encode_image_chunk(items):
    return [_encode_row(item, _image_worker["encoder"]) for item in items]


def _encoded_rows(items, encoder, num_proc: int):
    """Per row of ``items``, _encode_row's result, in order: in this process, or in
    ``num_proc`` forked workers (the same results for any count)."""
    from .worker_pool import forked_pool, in_order

    chunks = (items[i:i + IMAGE_CHUNK] for i in range(0, len(items), IMAGE_CHUNK))
    if num_proc <= 1:
        for chunk in chunks:
            yield from (_encode_row(item, encoder) for item in chunk)
        return
    with forked_pool(num_proc, _init_image_worker, (encoder,)) as pool:
        for _, rows in in_order(pool, _encode_image_chunk, ((None, c) for c in chunks),
                                num_proc):
            yield from rows


def _build(sources, columns, flag: str, encoder, identity: dict, num_proc: int = 1,
           absolute_only: bool = False):
    def build(job) -> dict:
        from tqdm import tqdm

        from .multimodal import read_image_conversations

        per_source = [read_image_conversations([s], columns, flag) for s in sources]
        items = [item for rows in per_source for item in rows]
        w = {name: job.writer(name) for name in IMAGE_SCHEMA}
        offsets = ("offsets", "image_offsets", "ref_offsets", "video_offsets",
                   "file_offsets", "file_ref_offsets")
        for name in offsets:
            w[name].append(np.zeros(1, np.int64))
        ends = dict.fromkeys(offsets, 0)
        relative = False
        bar = tqdm(total=len(items), desc="encoding image conversations", unit="conv",
                   disable=None, leave=False)
        try:
            for ids, targets, images, videos in _encoded_rows(items, encoder, num_proc):
                w["ids"].append(ids)
                w["targets"].append(targets)
                w["answers"].append(np.asarray([int(targets[1:].sum())], np.int64))
                for name, size in (("offsets", len(ids)), ("image_offsets", len(images)),
                                   ("video_offsets", len(videos))):
                    ends[name] += size
                    w[name].append(np.asarray([ends[name]], np.int64))
                for is_list, grid, second, files in videos:
                    w["video_lists"].append(np.asarray([is_list]))
                    w["video_grids"].append(np.asarray([grid], np.int64))
                    w["video_seconds"].append(np.asarray([second], np.float32))
                    ends["file_offsets"] += len(files)
                    w["file_offsets"].append(np.asarray([ends["file_offsets"]], np.int64))
                    for name, digest, stamp, is_relative in files:
                        relative |= is_relative
                        w["file_refs"].append(np.frombuffer(name, np.uint8))
                        ends["file_ref_offsets"] += len(name)
                        w["file_ref_offsets"].append(
                            np.asarray([ends["file_ref_offsets"]], np.int64))
                        w["file_digests"].append(np.frombuffer(digest, np.uint8)[None])
                        w["file_stamps"].append(np.asarray([stamp], np.int64))
                for name, inline, grid, digest, stamp, is_relative in images:
                    relative |= is_relative
                    w["refs"].append(np.frombuffer(name, np.uint8))
                    ends["ref_offsets"] += len(name)
                    w["ref_offsets"].append(np.asarray([ends["ref_offsets"]], np.int64))
                    w["inline"].append(np.asarray([inline]))
                    w["grids"].append(np.asarray([grid], np.int64))
                    w["digests"].append(np.frombuffer(digest, np.uint8)[None])
                    w["stamps"].append(np.asarray([stamp], np.int64))
                bar.update(1)
        finally:
            bar.close()
        for name, inner in (("grids", 3), ("digests", 32), ("stamps", 2),
                            ("video_grids", 3), ("file_digests", 32), ("file_stamps", 2)):
            if w[name].inner is None:  # no image at all: still a 2-D array of its width
                w[name].append(np.zeros((0, inner), np.dtype(IMAGE_SCHEMA[name][0])))
        return {"conversations": len(items), "split": 0, "identity": identity,
                "sources": [s.path for s in sources],
                "rows": [len(rows) for rows in per_source],
                "cwd": os.getcwd() if relative and not absolute_only else None}

    return build


# ---- checking ----------------------------------------------------------------------------

def _ref(arrays, i: int) -> bytes:
    offsets = arrays["ref_offsets"]
    return arrays["refs"][offsets[i]:offsets[i + 1]].tobytes()


def _path(arrays, i: int) -> str:
    return _ref(arrays, i).decode("utf-8", "surrogateescape")


def _file_path(arrays, f: int) -> str:
    offsets = arrays["file_ref_offsets"]
    return arrays["file_refs"][offsets[f]:offsets[f + 1]].tobytes().decode(
        "utf-8", "surrogateescape")


def file_sha256(path: str, where: str) -> bytes:
    return hashlib.sha256(read_image_bytes(path, where)[0]).digest()


def changed_image(arrays) -> Optional[str]:
    """What is wrong with the first stored image or video file that is gone or whose bytes
    changed (hashed only where its size or mtime moved), or None."""
    from ..input_files import MAX_VIDEO_BYTES

    seen: Dict[str, bool] = {}
    images = ((_path(arrays, int(i)), arrays["stamps"][i], arrays["digests"][i], "image",
               MAX_IMAGE_BYTES) for i in np.flatnonzero(~np.asarray(arrays["inline"])))
    lists = np.repeat(np.asarray(arrays["video_lists"]), np.diff(arrays["file_offsets"]))
    videos = ((_file_path(arrays, f), arrays["file_stamps"][f], arrays["file_digests"][f],
               "video frame" if lists[f] else "video",
               MAX_IMAGE_BYTES if lists[f] else MAX_VIDEO_BYTES)
              for f in range(len(arrays["file_digests"])))
    for entries in (images, videos):
        for path, stamp, digest, kind, limit in entries:
            try:
                st = os.stat(path)
            except (OSError, ValueError) as err:  # ValueError: a NUL in a tampered path
                return f"its {kind} {path!r} cannot be read ({getattr(err, 'strerror', err)})"
            if (st.st_size, st.st_mtime_ns) == tuple(stamp):
                continue
            if path not in seen:
                try:
                    seen[path] = hashed_file(path, path, limit)[0] == digest.tobytes()
                except ArgumentError as err:
                    return f"its {kind} {err}"
            if not seen[path]:
                return f"its {kind} {path} changed since it was stored (its sha256 differs)"
    return None


def _check_videos(arrays, samples: int, merge: int) -> None:
    """ValueError unless the video arrays are consistent with each other and the samples."""
    offsets, grids = arrays["video_offsets"], arrays["video_grids"]
    v = len(grids)
    if len(offsets) != samples + 1 or offsets[0] != 0 or offsets[-1] != v or \
            (np.diff(offsets) < 0).any():
        raise ValueError("its video offsets are out of order")
    files = arrays["file_offsets"]
    f = len(arrays["file_digests"])
    if grids.shape[1:] != (3,) or len(arrays["video_seconds"]) != v or \
            len(arrays["video_lists"]) != v or arrays["file_digests"].shape != (f, 32) or \
            arrays["file_stamps"].shape != (f, 2):
        raise ValueError("its video arrays disagree in shape")
    if len(files) != v + 1 or files[0] != 0 or files[-1] != f or (np.diff(files) <= 0).any():
        raise ValueError("its video files are out of order")
    if v and ((grids <= 0).any() or (grids[:, 1:] % merge).any() or
              not np.isfinite(arrays["video_seconds"]).all() or
              (arrays["video_seconds"] <= 0).any()):
        raise ValueError(f"its video grids are not whole {merge}x{merge} merges")
    refs = arrays["file_ref_offsets"]
    if len(refs) != f + 1 or refs[0] != 0 or refs[-1] != len(arrays["file_refs"]) or \
            (np.diff(refs) <= 0).any():
        raise ValueError("its video file references are out of order")


def _check(vocab_size: int, merge: int, cwd_matters: bool, images: bool = True):
    """check(arrays, meta) for array_cache: ValueError unless the arrays are a consistent
    set of image samples whose image files are those stored (``images``)."""
    def check(arrays, meta) -> None:
        _check_sft_arrays(arrays, meta, vocab_size)
        samples = len(arrays["answers"])
        image_offsets, grids = arrays["image_offsets"], arrays["grids"]
        n = len(grids)
        if len(image_offsets) != samples + 1 or image_offsets[0] != 0 or \
                image_offsets[-1] != n or (np.diff(image_offsets) < 0).any():
            raise ValueError("its image offsets are out of order")
        if grids.shape[1:] != (3,) or arrays["digests"].shape != (n, 32) or \
                arrays["stamps"].shape != (n, 2) or len(arrays["inline"]) != n:
            raise ValueError("its image arrays disagree in shape")
        if n and ((grids <= 0).any() or (grids[:, 1:] % merge).any()):
            raise ValueError(f"its patch grids are not whole {merge}x{merge} merges")
        ref_offsets = arrays["ref_offsets"]
        if len(ref_offsets) != n + 1 or ref_offsets[0] != 0 or \
                ref_offsets[-1] != len(arrays["refs"]) or (np.diff(ref_offsets) <= 0).any():
            raise ValueError("its image references are out of order")
        _check_videos(arrays, samples, merge)
        rows, sources = meta.get("rows"), meta.get("sources")
        if not isinstance(rows, list) or not isinstance(sources, list) or \
                len(rows) != len(sources) or \
                not all(isinstance(r, int) and r >= 0 for r in rows) or \
                not all(isinstance(s, str) for s in sources) or \
                sum(rows) != samples or meta["conversations"] != samples:
            raise ValueError("its manifest does not say which row each sample is")
        cwd = meta.get("cwd")
        if cwd_matters and cwd is not None and cwd != os.getcwd():
            raise ValueError(f"its relative image paths were resolved in {cwd}; this run "
                             f"starts in {os.getcwd()}")
        if images:
            problem = changed_image(arrays)
            if problem:
                raise ValueError(problem)

    return check


# ---- the stored samples and their images -------------------------------------------------

class CachedImages:
    """The stored image samples' images: a sample's patches made again from its images'
    bytes, checked against the stored sha256 and grid before they are used."""

    def __init__(self, tokenized, arrays, meta: dict, encoder, flag: str,
                 cache_folder: Optional[str] = None):
        """``cache_folder``: the token cache's folder these arrays are mapped from (None
        for a --cached_dataset folder, which is the user's and never discarded)."""
        self.tokenized, self.arrays, self.encoder, self.flag = tokenized, arrays, encoder, flag
        self.cache_folder = cache_folder
        self.starts = np.asarray(tokenized.encoded.starts)
        self.sources = list(meta["sources"])
        self.first_rows = np.cumsum([0] + list(meta["rows"]))

    def where(self, k: int) -> str:
        """The file and row sample ``k`` was read from."""
        source = int(np.searchsorted(self.first_rows, k, side="right")) - 1
        return f"{self.flag} {self.sources[source]}, row {k - int(self.first_rows[source])}"

    def index(self, start: int) -> int:
        """The sample whose tokens start at ``start`` (samples are never cut)."""
        return int(np.searchsorted(self.starts, start))

    def discard(self) -> str:
        """What to do about stored tokens found stale: the cache's folder is set aside (its
        file's size and mtime did not move, so the next start could not tell); a prepared
        folder is the user's to prepare again."""
        if self.cache_folder is None:
            return ("prepare the --cached_dataset folder again with `swift-mcore preprocess "
                    "sft`, or put back the file it was prepared with")
        from .array_cache import _set_aside

        try:
            _set_aside(self.cache_folder)
        except OSError:  # another process set it aside first
            pass
        return "its cached tokens are discarded: start the run again to encode it anew"

    def image_tokens(self, k: int, grids: str = "grids", offsets: str = "image_offsets") -> int:
        a = self.arrays
        grids = np.asarray(a[grids][a[offsets][k]:a[offsets][k + 1]])
        return int((grids.prod(-1) // self.encoder.merge ** 2).sum())

    def video_tokens(self, k: int) -> int:
        return self.image_tokens(k, "video_grids", "video_offsets")

    def has_videos(self) -> bool:
        return len(self.arrays["video_grids"]) > 0

    def videos(self, samples: Sequence[int]):
        """(pixel_values_videos, video_grid_thw, second_per_grid_ts) of the videos of
        ``samples``, or None if they have none: each video's files hashed (and checked
        against the stored sha256) before it is decoded again, its grid and seconds per
        temporal patch then checked against the stored ones. ArgumentError naming the row
        and video whose file changed since it was stored."""
        with contextlib.ExitStack() as stack:  # the held videos' handles
            return self._videos(samples, stack)

    def _videos(self, samples: Sequence[int], stack):
        import torch

        a, videos, wheres, stored = self.arrays, [], [], []
        for k in samples:
            ids, _ = self.tokenized.encoded.sample(k)
            if int((ids == self.encoder.video_pad_id).sum()) != self.video_tokens(k):
                raise ArgumentError(f"{self.where(k)}: the stored tokens do not hold its "
                                    f"videos' pads (a damaged cache: remove it)")
            lo, hi = int(a["video_offsets"][k]), int(a["video_offsets"][k + 1])
            for v in range(lo, hi):
                at = f"{self.where(k)}: videos[{v - lo}]"
                files = []
                for f in range(int(a["file_offsets"][v]), int(a["file_offsets"][v + 1])):
                    path = _file_path(a, f)
                    if "\0" in path:
                        raise ArgumentError(f"{at}: a stored path holds a NUL byte (a "
                                            f"damaged cache: remove it)")
                    files.append((path, f))
                video = tuple(p for p, _ in files) if a["video_lists"][v] else files[0][0]

                def check(i, digest, at=at, files=files):
                    path, f = files[i]
                    if digest != a["file_digests"][f].tobytes():
                        raise ArgumentError(f"{at} {path}: changed since its tokens were "
                                            f"stored (its sha256 differs); {self.discard()}")

                videos += _held_videos([video], [at], stack, check)
                wheres.append(at)
                stored.append(v)
        if not videos:
            return None
        pixels, grids, seconds = self.encoder.video_patches(videos, wheres)
        want_grids = torch.as_tensor(np.asarray(a["video_grids"][stored]), dtype=grids.dtype)
        want_seconds = torch.as_tensor(np.asarray(a["video_seconds"][stored]))
        if not torch.equal(grids, want_grids) or not torch.equal(seconds, want_seconds):
            raise ArgumentError(f"{self.where(samples[0])}: its videos' grids "
                                f"{grids.tolist()} (seconds per temporal patch "
                                f"{seconds.tolist()}) are not the stored "
                                f"{want_grids.tolist()} ({want_seconds.tolist()}): the "
                                f"video processing changed; restart the run")
        return pixels, grids, seconds

    def patches(self, samples: Sequence[int]):
        """(pixel_values, image_grid_thw) of the images of ``samples``, or None if they have
        none. ArgumentError naming the row and image whose file changed since it was
        stored, and for stored arrays that disagree with themselves."""
        import torch

        a, pictures, grids = self.arrays, [], []
        for k in samples:
            lo, hi = int(a["image_offsets"][k]), int(a["image_offsets"][k + 1])
            ids, _ = self.tokenized.encoded.sample(k)
            if int((ids == self.encoder.pad_id).sum()) != self.image_tokens(k):
                raise ArgumentError(f"{self.where(k)}: the stored tokens do not hold its "
                                    f"images' pads (a damaged cache: remove it)")
            for i in range(lo, hi):
                if a["inline"][i]:
                    data, at = _ref(a, i), f"{self.where(k)}: images[{i - lo}] (inline)"
                else:
                    path = _path(a, i)
                    at = f"{self.where(k)}: images[{i - lo}] {path}"
                    if "\0" in path:
                        raise ArgumentError(f"{at}: a stored path holds a NUL byte (a "
                                            f"damaged cache: remove it)")
                    data = read_image_bytes(path, at)[0]
                if hashlib.sha256(data).digest() != a["digests"][i].tobytes():
                    raise ArgumentError(f"{at}: changed since its tokens were stored (its "
                                        f"sha256 differs); {self.discard()}")
                pictures.append(picture(data, at))
                grids.append(a["grids"][i])
        if not pictures:
            return None
        pixels, made = self.encoder.patches((), pictures)
        if not torch.equal(made, torch.as_tensor(np.asarray(grids), dtype=made.dtype)):
            raise ArgumentError(f"{self.where(samples[0])}: its images' patch grids "
                                f"{made.tolist()} are not the stored {np.asarray(grids).tolist()}"
                                f" (the image processor changed): restart the run")
        return pixels, made


def cached_image_tokens(sources, columns, flag: str, encoder, num_proc: int = 1,
                        on_event: Callable[[str], None] = lambda event: None) -> CachedImages:
    """The image samples of ``sources`` from the token cache, encoded into it first (in
    ``num_proc`` worker processes) when missing, or when an image changed since
    (``on_event`` hears "built" or "reused")."""
    from .array_cache import cache_folder, cached_arrays
    from .sources import content_fingerprint
    from .token_cache import _tokenized

    identity = image_identity(content_fingerprint(sources), encoder, columns)
    key = json.dumps(identity, sort_keys=True)
    arrays, meta = cached_arrays(
        "sft-images", key, IMAGE_SCHEMA,
        _build(sources, columns, flag, encoder, identity, num_proc),
        check=_check(encoder.template.tokenizer.vocab_size, encoder.merge, True),
        on_event=on_event)
    return CachedImages(_tokenized(arrays, meta), arrays, meta, encoder, flag,
                        cache_folder("sft-images", key))


def write_image_sft_dataset(folder: str, sources, columns, encoder, num_proc: int = 1) -> dict:
    """The image samples of ``sources`` written to ``folder`` (which must not exist): what
    `swift-mcore preprocess sft` writes for a vision-language --model. Images stay in their
    files, recorded by absolute path and sha256."""
    from .array_cache import build_folder
    from .sources import content_fingerprint

    identity = image_identity(content_fingerprint(sources), encoder, columns)
    build_folder(folder, json.dumps(identity, sort_keys=True), IMAGE_SCHEMA,
                 _build(sources, columns, "--dataset", encoder, identity, num_proc,
                        absolute_only=True))
    return identity


def load_image_sft_dataset(folder: str, encoder, columns, flag: str = "--cached_dataset",
                           images: bool = True) -> Tuple[CachedImages, dict]:
    """(CachedImages, identity) of a folder `swift-mcore preprocess sft` wrote for image
    rows. ArgumentError for a folder that is not one, was made with another tokenizer,
    template, image processor or flag than this run's, or one of whose image files is
    gone or changed (``images``: checked)."""
    from .token_cache import _tokenized, load_prepared

    arrays, meta, theirs = load_prepared(
        folder, flag, "a dataset of image rows", IMAGE_SCHEMA,
        _check(encoder.template.tokenizer.vocab_size, encoder.merge, False, images=False),
        lambda sources: image_identity(sources, encoder, columns), FLAGS)
    if images:
        problem = changed_image(arrays)
        if problem:
            raise ArgumentError(f"{flag} {folder}: {problem}; the images and videos must "
                                f"stay where they were when it was prepared: restore them, "
                                f"or prepare the folder again")
    return CachedImages(_tokenized(arrays, meta), arrays, meta, encoder, "--dataset"), theirs


def image_processor(folder: str, sft):
    """The --model folder's image processor, with --max_pixels / --min_pixels when given."""
    from .multimodal import load_image_processor

    sizes = {k: getattr(sft, k) for k in ("min_pixels", "max_pixels") if getattr(sft, k)}
    processor = load_image_processor(folder, "--model", **sizes)
    size = dict(getattr(processor, "size", None) or {})
    low = size.get("shortest_edge", getattr(processor, "min_pixels", None))
    high = size.get("longest_edge", getattr(processor, "max_pixels", None))
    said = lambda flag, value, key: (  # noqa: E731
        f"--{flag} {value}" if flag in sizes else
        f"{folder}/preprocessor_config.json's {key} {value}")
    if low and high and low > high:  # smart_resize would drop the minimum without a word
        raise ArgumentError(f"{said('min_pixels', low, 'shortest_edge')} is above "
                            f"{said('max_pixels', high, 'longest_edge')}: an image cannot "
                            f"have both; give --min_pixels at most --max_pixels")
    from ..input_files import MAX_IMAGE_PIXELS

    if low and low > MAX_IMAGE_PIXELS:  # every image scaled up to it: memory runs out
        raise ArgumentError(f"{said('min_pixels', low, 'shortest_edge')} is above "
                            f"{MAX_IMAGE_PIXELS} pixels, the most an image may have; give "
                            f"--min_pixels at most that")
    return processor


def image_encoder(config, tokenizer):
    """The run's ImageEncoder: its template (the sft flags) and the folder's processor."""
    from .multimodal import ImageEncoder
    from .templates import Template

    s = config.sft
    template = Template(s.template, tokenizer, system=s.system,
                        train_separator=s.train_separator,
                        ignore_empty_think=s.ignore_empty_think)
    from ..models.vision import TIMESTAMP_TYPES
    from .video import VideoSampling

    return ImageEncoder(template, image_processor(config.model.model, s), s.loss_on,
                        VideoSampling.from_args(s),
                        timestamps=config.model.model_type in TIMESTAMP_TYPES)


def check_lengths(images: CachedImages, seq_length: int) -> None:
    """ArgumentError naming the first sample longer than ``seq_length`` (images and videos
    are never cut)."""
    lengths = images.tokenized.encoded.ends - images.tokenized.encoded.starts
    long = np.flatnonzero(lengths > seq_length)
    if len(long):
        k = int(long[0])
        if images.has_videos():
            raise ArgumentError(
                f"{images.where(k)}: {int(lengths[k])} tokens "
                f"({images.image_tokens(k) + images.video_tokens(k)} of them its images' and "
                f"videos'), more than --seq_length {seq_length} (images and videos are not "
                f"cut, nor their rows dropped, whatever --truncation_strategy); raise --seq_length or give smaller images (--max_pixels) or fewer, "
                f"smaller video frames (--fps_max_frames, --video_max_pixels)")
        raise ArgumentError(
            f"{images.where(k)}: {int(lengths[k])} tokens ({images.image_tokens(k)} of them "
            f"its images'), more than --seq_length {seq_length} (images are not cut, nor their "
            f"rows dropped, whatever --truncation_strategy); raise "
            f"--seq_length or give smaller images")
