"""Videos for Qwen VL models: frames sampled, resized and cut into patches as Qwen's own
processing does (qwen_vl_utils' rules, which ms-swift applies), read with PyAV.

Sampling (qwen_vl_utils' smart_nframes): a video of ``total`` frames at ``video_fps``
keeps ``total / video_fps * --fps`` frames, raised to ``--fps_min_frames`` (rounded up to
a multiple of the tower's temporal_patch_size), cut to ``min(--fps_max_frames, total)``
(rounded down), then to ``total``, rounded down to a multiple of temporal_patch_size; the
frames taken are ``round(linspace(0, total - 1, n))``. The sampled frames' rate,
``n / total * video_fps``, gives transformers' ``second_per_grid_ts``
(``temporal_patch_size / rate``). A list of frame images is taken whole (its last frame
repeated up to a multiple of temporal_patch_size) at ``--fps``, and sized by the video
limits below (qwen_vl_utils sizes each by the image limits): a frame list and the video
file of the same frames give the same patches.

Resizing (qwen_vl_utils' fetch_video): each frame keeps its aspect, its sides become
multiples of factor = patch_size x merge_size and its pixels lie within
``--video_min_pixels`` and ``max(min(--video_max_pixels, --video_total_pixels / n *
temporal_patch_size), 1.05 * --video_min_pixels)`` (smart_resize); by default 128, 768 and
115,200 merged patches' pixels (128 x 28 x 28 ... for Qwen2.5-VL, x 32 x 32 for Qwen3-VL).

Frames are resized with the image processor's resampling filter (PIL's bicubic;
transformers' and qwen_vl_utils' readers use torchvision's antialiased bicubic on tensors,
which differs from PIL's by rounding) and normalized by the image processor itself, so a
video whose frames are one still image has that image's patches.

Qwen3-VL's prompt gives each frame group its time: the mean of its first and last frames'
``index / video_fps`` (a frame list's frames are 0, 1, ... at --fps).

Patches: ``t = n / temporal_patch_size`` groups of consecutive frames, each patch holding
its group's frames side by side (the layout of transformers' Qwen2-VL video processor);
``video_grid_thw`` is ``(t, h / patch, w / patch)``.

A video file is opened once per use: probed and decoded from that one handle (the token
cache hashes it through the same handle first: HeldVideo). Decoding is bounded before it
starts: the file is a regular file of at most input_files.MAX_VIDEO_BYTES, its header's
frames are at most MAX_IMAGE_PIXELS each and its frame count (packets counted, nothing
decoded) at most MAX_VIDEO_FRAMES; frames are decoded up to the last sampled one and each
is resized as it comes, so memory holds the sampled frames at their model size only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

from ..errors import ArgumentError

# qwen_vl_utils' defaults, which ms-swift reads from the environment under these names
# upper-cased; the pixel ones count merged patches of factor x factor pixels (factor = patch
# x merge: 28 for Qwen2.5-VL, 32 for Qwen3-VL)
DEFAULT_FPS = 2.0
DEFAULT_MIN_FRAMES = 4
DEFAULT_MAX_FRAMES = 768
MIN_TOKENS, MAX_TOKENS, TOTAL_TOKENS = 128, 768, 128000 * 0.9
MAX_RATIO = 200  # the longest side over the shortest, as smart_resize allows

@dataclass(frozen=True)
class VideoSampling:
    """The sampling and size knobs (ms-swift's names, lower-cased: --fps, ...)."""

    fps: float = DEFAULT_FPS
    fps_min_frames: int = DEFAULT_MIN_FRAMES
    fps_max_frames: int = DEFAULT_MAX_FRAMES
    # None: MIN_TOKENS (MAX_TOKENS, TOTAL_TOKENS) x factor x factor pixels
    video_min_pixels: Optional[int] = None
    video_max_pixels: Optional[int] = None
    video_total_pixels: Optional[int] = None

    def pixels(self, factor: int) -> Tuple[int, int, int]:
        """(min, max, total) pixels of a video for merged patches of ``factor`` pixels."""
        area = factor * factor
        return (self.video_min_pixels or MIN_TOKENS * area,
                self.video_max_pixels or MAX_TOKENS * area,
                self.video_total_pixels or int(TOTAL_TOKENS * area))

    @classmethod
    def from_args(cls, args: Any) -> "VideoSampling":
        """From flags of these names (None: the default)."""
        given = {k: getattr(args, k, None) for k in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in given.items() if v is not None})


def _floor(x: float, factor: int) -> int:
    return math.floor(x / factor) * factor


def _ceil(x: float, factor: int) -> int:
    return math.ceil(x / factor) * factor


def frame_count(total: int, video_fps: float, sampling: VideoSampling, factor: int,
                where: str) -> int:
    """How many frames of a ``total``-frame video at ``video_fps`` are kept (module
    docstring); ArgumentError naming ``where`` when fewer than ``factor`` can be."""
    low = _ceil(sampling.fps_min_frames, factor)
    high = _floor(min(sampling.fps_max_frames, total), factor)
    n = total / video_fps * sampling.fps
    n = _floor(min(max(n, low), high, total), factor)
    if not factor <= n <= total:
        raise ArgumentError(f"{where}: {total} frame(s) at {video_fps:g} fps give {n} "
                            f"sampled frames; a video needs at least {factor} "
                            f"(the tower's temporal_patch_size; --fps_max_frames "
                            f"{sampling.fps_max_frames})")
    return n


def frame_indices(total: int, n: int) -> List[int]:
    """The ``n`` frames taken of ``total``: ``round(linspace(0, total - 1, n))`` (torch's
    float32 linspace and half-to-even rounding, as qwen_vl_utils computes them)."""
    import torch

    return torch.linspace(0, total - 1, n).round().long().tolist()


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: float,
                 where: str) -> Tuple[int, int]:
    """(height, width) multiples of ``factor`` with the aspect kept and the pixels within
    [min_pixels, max_pixels] (qwen_vl_utils' rule)."""
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ArgumentError(f"{where}: {width}x{height} pixels, an aspect ratio over "
                            f"{MAX_RATIO} (Qwen's resizing refuses it)")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, _floor(height / beta, factor))
        w = max(factor, _floor(width / beta, factor))
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = _ceil(height * beta, factor)
        w = _ceil(width * beta, factor)
    return h, w


def frame_size(height: int, width: int, n: int, sampling: VideoSampling, factor: int,
               temporal: int, where: str) -> Tuple[int, int]:
    """The size every one of ``n`` sampled frames is resized to (module docstring)."""
    low, high, total = sampling.pixels(factor)
    most = max(min(high, total / n * temporal), int(low * 1.05))
    return smart_resize(height, width, factor, low, most, where)


@dataclass
class Frames:
    """A video's sampled frames at their model size, and the rate they were taken at."""

    images: List[Any]   # PIL RGB images, all one size
    sample_fps: float
    indices: List[int]  # which frames of the video they are
    video_fps: float    # the video's frame rate (a frame list's: --fps)

    def timestamps(self, temporal: int) -> List[float]:
        """Each frame group's time in seconds: the mean of its first and last frames'
        (Qwen3-VL's processor writes them into the prompt)."""
        times = [i / self.video_fps for i in self.indices]
        return [(times[i] + times[i + temporal - 1]) / 2
                for i in range(0, len(times), temporal)]


def _resized(image, size: Tuple[int, int], resample):
    h, w = size
    image = image.convert("RGB")
    return image if image.size == (w, h) else image.resize((w, h), resample=resample)


# A held video's blocks: each is hashed when the file is, and checked again when the decoder
# reads it (a list of 2,048 digests for the largest video).
BLOCK = 1 << 20


class HeldVideo:
    """A video file opened once (``open``: by read_video_file when it decodes it, so that a
    row's or a batch's videos are not all open at once) and hashed through that handle (its
    sha256, and each BLOCK's; ``check(digest)``, if given, runs on the sha256 before any
    decoding), then probed and decoded from the same handle (``reader``): a path renamed
    over meanwhile is never read, and each block the decoder reads is hashed again before it
    is used, so the frames decoded are those of the bytes hashed or the decoding stops
    (``unmoved`` says so). Only the hashes are held, never the file."""

    def __init__(self, path: str, where: str, limit: int,
                 check: Optional[Callable[[bytes], None]] = None):
        self.path, self.where, self.limit, self.check = path, where, limit, check
        self.changed, self.file = False, None
        self.digest: Optional[bytes] = None
        self.stamp: Optional[Tuple[int, int]] = None

    def open(self) -> None:
        import hashlib
        import os

        from ..input_files import open_regular

        self.changed = False
        self.file = open_regular(self.path, "rb", self.where)
        try:
            st = os.fstat(self.file.fileno())
            self.stamp = (st.st_size, st.st_mtime_ns)
            whole, self.blocks, self.size = hashlib.sha256(), [], 0
            while True:
                chunk = self.file.read(BLOCK)  # whole blocks but the last (a buffered read)
                if not chunk:
                    break
                self.size += len(chunk)
                if self.size > self.limit:
                    raise ArgumentError(f"{self.where}: more than {self.limit >> 20} MiB")
                whole.update(chunk)
                self.blocks.append(hashlib.sha256(chunk).digest())
            self.digest = whole.digest()
            if self.check is not None:
                self.check(self.digest)
        except BaseException:
            self.close()
            raise

    def reader(self) -> "_CheckedReader":
        """A file object at offset 0 over the bytes hashed, for PyAV."""
        return _CheckedReader(self)

    def unmoved(self) -> None:
        """ArgumentError if a block read back differed from the one hashed, or the open
        file's size or mtime moved, while it was decoded."""
        import os

        st = os.fstat(self.file.fileno())
        if self.changed or (st.st_size, st.st_mtime_ns) != self.stamp:
            raise ArgumentError(f"{self.where}: changed while it was decoded")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


# Blocks a reader keeps once checked: a container whose tracks are stored apart (an MP4
# with its audio after its video) has the demuxer go back and forth between regions of the
# file, each region's block kept rather than read and hashed again per packet.
KEPT_BLOCKS = 4


class _CheckedReader:
    """Reads a HeldVideo's hashed bytes block by block, each block's sha256 checked before
    any of it is handed out, the last KEPT_BLOCKS blocks kept (PyAV calls read, seek and
    tell)."""

    def __init__(self, held: HeldVideo):
        from collections import OrderedDict

        self.held, self.pos, self.index, self.block = held, 0, -1, b""
        self.kept: "OrderedDict[int, bytes]" = OrderedDict()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self.pos, self.held.size)[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def read(self, n: int = -1) -> bytes:
        import hashlib

        held = self.held
        if self.pos >= held.size or n == 0:
            return b""
        index = self.pos // BLOCK
        if index != self.index:
            block = self.kept.pop(index, None)
            if block is None:
                held.file.seek(index * BLOCK)
                block = held.file.read(BLOCK)
                if hashlib.sha256(block).digest() != held.blocks[index]:
                    held.changed = True
                    raise ArgumentError(f"{held.where}: changed while it was decoded")
            self.kept[index] = block
            if len(self.kept) > KEPT_BLOCKS:
                self.kept.popitem(last=False)
            self.index, self.block = index, block
        start = self.pos - index * BLOCK
        out = self.block[start:] if n < 0 else self.block[start:start + n]
        self.pos += len(out)
        return out


def video_name(video) -> str:
    """The path of a video given as its path or held (HeldVideo)."""
    return video.path if isinstance(video, HeldVideo) else video


def read_video_file(video, where: str, sampling: VideoSampling, factor: int,
                    temporal: int, resample) -> Frames:
    """The sampled frames of a video file, its path or held (HeldVideo): opened once,
    probed (regular, bounded) and decoded up to the last frame taken from that one handle,
    each frame resized as it comes. ArgumentError naming ``where`` for a file that does not
    decode to the frames its header promises, or a held one whose bytes changed."""
    from contextlib import ExitStack

    held = isinstance(video, HeldVideo)
    with ExitStack() as stack:
        if held:
            if video.file is None:  # opened here, closed here
                video.open()
                stack.callback(video.close)
            fh, size = video.reader(), video.size
        else:
            import os

            from ..input_files import open_regular

            fh = stack.enter_context(open_regular(video, "rb", where))
            size = os.fstat(fh.fileno()).st_size
        try:
            frames = _decoded(fh, size, where, sampling, factor, temporal, resample)
        except ArgumentError:
            if held and video.changed:
                video.unmoved()  # the changed bytes, not what the decoder made of them
            raise
        if held:
            video.unmoved()
        return frames


def _decoded(fh, size: int, where: str, sampling: VideoSampling, factor: int,
             temporal: int, resample) -> Frames:
    import av

    from ..input_files import probe_video

    info = probe_video(fh, size, where)
    n = frame_count(info.frames, info.fps, sampling, temporal, where)
    wanted = frame_indices(info.frames, n)
    size = frame_size(info.height, info.width, n, sampling, factor, temporal, where)
    last, images, index = wanted[-1], [], -1
    fh.seek(0)
    try:
        with av.open(fh) as container:
            stream = container.streams.video[0]
            at = 0
            for frame in container.decode(stream):
                index += 1
                if (frame.width, frame.height) != (info.width, info.height):
                    raise ArgumentError(f"{where}: frame {index} is {frame.width}x"
                                        f"{frame.height}, the video's header says "
                                        f"{info.width}x{info.height}")
                while at < n and wanted[at] == index:  # an index may repeat
                    images.append(_resized(frame.to_image(), size, resample))
                    at += 1
                if index >= last:
                    break
    except av.error.FFmpegError as err:
        raise ArgumentError(f"{where}: cannot be decoded ({err.strerror or err})") from None
    if index < 0:
        raise ArgumentError(f"{where}: decodes to no frames (a video with frames is needed)")
    if len(images) < n:
        raise ArgumentError(f"{where}: decodes to {index + 1} frame(s), its header counts "
                            f"{info.frames}")
    return Frames(images, n / info.frames * info.fps, wanted, info.fps)


class HeldFrame:
    """A frame image of a frame list, read when it is decoded: its bytes read once (bounded),
    hashed (``digest``, ``stamp``: (size, mtime_ns)) and decoded from those bytes, then let
    go, so that a list's frames are never all held at once. ``check(digest)``, if given,
    runs on the hash before the bytes are decoded (a cache refusing a changed frame)."""

    def __init__(self, path: str, check: Optional[Callable[[bytes], None]] = None):
        self.path, self.check = path, check
        self.digest: Optional[bytes] = None
        self.stamp: Optional[Tuple[int, int]] = None

    def image(self, where: str):
        import hashlib
        import io
        import os

        from PIL import Image

        from ..input_files import MAX_IMAGE_BYTES, check_image_bytes, open_regular

        with open_regular(self.path, "rb", where) as fh:
            st = os.fstat(fh.fileno())
            data = fh.read(MAX_IMAGE_BYTES + 1)
        check_image_bytes(data, where)
        self.digest, self.stamp = hashlib.sha256(data).digest(), (st.st_size, st.st_mtime_ns)
        if self.check is not None:
            self.check(self.digest)
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")


def read_frame_list(paths: Sequence[Any], where: str, sampling: VideoSampling, factor: int,
                    temporal: int, resample, load_image) -> Frames:
    """A video given as its frames' image paths (or HeldFrame): all of them, the last
    repeated up to a multiple of ``temporal``, at --fps; every frame must have the first
    one's size. Each frame is resized as it is decoded (the size follows from the first
    frame's and the count), so one frame at full size is held at a time."""
    names = [p.path if isinstance(p, HeldFrame) else p for p in paths]
    n = _ceil(len(paths), temporal)
    images, size, first = [], None, None
    for i, (p, name) in enumerate(zip(paths, names)):
        frame = p.image(f"{where}[{i}] {name}") if isinstance(p, HeldFrame) \
            else load_image(p, f"{where}[{i}] {name}")
        if first is None:
            first = frame.size
            size = frame_size(first[1], first[0], n, sampling, factor, temporal, where)
        elif frame.size != first:
            raise ArgumentError(f"{where}[{i}] {name}: {frame.size[0]}x{frame.size[1]} "
                                f"pixels, the video's first frame is {first[0]}x{first[1]} "
                                f"(a video's frames are one size)")
        images.append(_resized(frame, size, resample))
        del frame
    images += [images[-1]] * (n - len(images))
    return Frames(images, sampling.fps, list(range(n)), sampling.fps)


def patches(frames: Frames, image_processor) -> Tuple[Any, Tuple[int, int, int], float]:
    """(patches [t * h * w, channels * temporal * patch * patch], (t, h, w), seconds per
    temporal patch) of sampled frames: each frame normalized by the image processor (its
    resize off: the frames have their size), grouped by temporal_patch_size."""
    p = image_processor
    patch, merge, temporal = int(p.patch_size), int(p.merge_size), int(p.temporal_patch_size)
    out = p(images=frames.images, do_resize=False, return_tensors="pt")
    grid = out["image_grid_thw"]
    h, w = int(grid[0, 1]), int(grid[0, 2])
    n = len(frames.images)
    channels = out["pixel_values"].shape[-1] // (temporal * patch * patch)
    # per frame [h/m, w/m, m, m, C, temporal (copies of the frame), p, p]: one copy each
    one = out["pixel_values"].view(n, h // merge, w // merge, merge, merge, channels,
                                   temporal, patch, patch)[..., 0, :, :]
    one = one.reshape(n // temporal, temporal, *one.shape[1:])
    # -> [t, h/m, w/m, m, m, C, temporal, p, p]: a patch holds its group's frames
    video = one.permute(0, 2, 3, 4, 5, 6, 1, 7, 8).reshape(
        (n // temporal) * h * w, channels * temporal * patch * patch)
    return video.contiguous(), (n // temporal, h, w), temporal / frames.sample_fps
