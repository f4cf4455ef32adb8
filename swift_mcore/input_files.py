"""Reading input files safely: regular files only, names read from a file kept inside its
folder, JSON parsed and images and videos opened only within bounds (a leaf: imports only
errors).

Why: a FIFO or device named like a weight file blocks ``open`` forever (or streams without
end); an index or config naming ``../../etc/passwd`` would be read as weights; a JSON value
nested 100,000 levels deep exhausts the parser's recursion (a RecursionError, or a crash of a
C parser); an image header may claim a billion pixels, a video a billion frames. Every
problem is an ArgumentError whose message starts with what the caller names (a flag and
path, or a file and row), so the CLI prints it as one line.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import stat
from typing import Any, NamedTuple, Optional, Tuple

from .errors import ArgumentError

# Deeper than any real config, index, tokenizer or conversation row (tool schemas nest a
# few dozen levels at most), and far below what exhausts Python's or pyarrow's recursion.
MAX_JSON_DEPTH = 512
# A config.json, generation_config.json or safetensors index: kilobytes to a few megabytes.
MAX_SMALL_JSON_BYTES = 64 << 20

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]")


def kind_of(mode: int) -> str:
    """'a FIFO', 'a character device', ... for a non-regular file's st_mode."""
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _not_regular(path: str, mode: int, where: str) -> ArgumentError:
    return ArgumentError(f"{where or path}: is {kind_of(mode)}, not a regular file; swift-mcore "
                         f"reads input only from regular files")


def check_regular(path: str, where: str = "") -> None:
    """ArgumentError unless ``path`` (symlinks followed) is a regular file. stat never blocks,
    whatever the path is."""
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        raise ArgumentError(f"{where or path}: cannot be read ({err.strerror})") from None
    if not stat.S_ISREG(mode):
        raise _not_regular(path, mode, where)


def first_not_regular(folder: str) -> Optional[str]:
    """'NAME is a FIFO (named pipe)' (or a device, a socket, a link to nothing) for the first
    entry under ``folder``, in sorted order, that is not a regular file or a folder; None if
    there is none. stat only: nothing is opened, so nothing blocks."""
    for base, dirs, names in os.walk(folder):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(base, name)
            rel = os.path.relpath(path, folder)
            try:
                mode = os.stat(path).st_mode
            except OSError as err:
                return f"{rel} cannot be read ({err.strerror})"
            if not stat.S_ISREG(mode):
                return f"{rel} is {kind_of(mode)}, not a regular file"
    return None


def open_regular(path: str, mode: str = "rb", where: str = "", encoding: Optional[str] = None):
    """``open(path, mode)`` for reading, refusing anything but a regular file without ever
    blocking: opened non-blocking (a FIFO with no writer opens at once), checked with fstat
    on the open descriptor (no race with a swap of the path), then set blocking again."""
    if set(mode) - set("rbt"):
        raise ValueError(f"open_regular reads only; mode {mode!r}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise ArgumentError(f"{where or path}: cannot be read ({err.strerror})") from None
    try:
        st_mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(st_mode):
            raise _not_regular(path, st_mode, where)
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
        if "b" not in mode and encoding is None:
            encoding = "utf-8"
        return os.fdopen(fd, mode, encoding=encoding)
    except BaseException:
        os.close(fd)
        raise


def inside(folder: str, name: Any, where: str) -> str:
    """The path of ``name`` (read from a file, described by ``where``) within ``folder``;
    ArgumentError for a name that would leave it: absolute, ``~``, or ``..`` that climbs
    out. Symlinks already in the folder are followed: they are its owner's doing, not the
    naming file's (a Hugging Face hub snapshot links every file into ../../blobs)."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise ArgumentError(f"{where}: {name!r:.80} is not a file name")
    if os.path.isabs(name) or name.startswith("~") or os.path.normpath(name).split(
            os.sep)[0] == os.pardir:
        raise ArgumentError(f"{where}: names {name!r:.200}, a path outside its folder "
                            f"{folder}; only files inside the folder are read")
    return os.path.join(folder, os.path.normpath(name))


# ---- images -------------------------------------------------------------------------------

# Larger than any photograph a VL model is trained on; bounds what one row may make us read.
MAX_IMAGE_BYTES = 64 << 20
MAX_IMAGE_PIXELS = 1 << 26  # 8192 x 8192; PIL's own decompression-bomb limit is ~89M


def check_image(path: str, where: str) -> Tuple[int, int]:
    """ArgumentError unless ``path`` is a regular file of at most MAX_IMAGE_BYTES that PIL
    reads as an image of at most MAX_IMAGE_PIXELS pixels (the header only: no decoding);
    its (width, height)."""
    check_regular(path, where)
    size = os.path.getsize(path)
    if size > MAX_IMAGE_BYTES:
        raise ArgumentError(f"{where}: {size} bytes, more than an image may have "
                            f"({MAX_IMAGE_BYTES >> 20} MiB)")
    with open_regular(path, "rb", where) as fh:
        return _check_image_header(fh, where)


def check_image_bytes(data: bytes, where: str) -> Tuple[int, int]:
    """check_image for an image given inline (base64 in a data row)."""
    import io

    if len(data) > MAX_IMAGE_BYTES:
        raise ArgumentError(f"{where}: {len(data)} bytes, more than an image may have "
                            f"({MAX_IMAGE_BYTES >> 20} MiB)")
    return _check_image_header(io.BytesIO(data), where)


def _check_image_header(fh, where: str) -> Tuple[int, int]:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(fh) as image:
            width, height = image.size
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        raise ArgumentError(f"{where}: not an image PIL can read") from None
    if width * height > MAX_IMAGE_PIXELS:
        raise ArgumentError(f"{where}: {width}x{height} pixels, more than {MAX_IMAGE_PIXELS} "
                            f"(downscale it)")
    return width, height


# ---- videos -------------------------------------------------------------------------------

# An hour of 1080p H.264 at 4 Mbit/s is 1.8 GB; the file is demuxed as a stream (never read
# whole into memory), so the bound is on the time one row may spend counting packets.
MAX_VIDEO_BYTES = 2 << 30
# Frames a video may have, counted before anything is decoded: 2.4 hours at 30 fps. The
# sampled frames decode up to the last one taken (qwen_vl_utils decodes the same span).
MAX_VIDEO_FRAMES = 1 << 18


class VideoInfo(NamedTuple):
    """What a video file's header and packets say: frames, their rate, their size."""

    frames: int
    fps: float
    width: int
    height: int


def check_video(path: str, where: str) -> VideoInfo:
    """ArgumentError unless ``path`` is a regular file of at most MAX_VIDEO_BYTES that PyAV
    opens, with a video stream of frames of at most MAX_IMAGE_PIXELS, a frame rate and
    1..MAX_VIDEO_FRAMES frames (packets counted: nothing is decoded)."""
    with open_regular(path, "rb", where) as fh:
        return probe_video(fh, os.fstat(fh.fileno()).st_size, where)


def probe_video(fh, size: int, where: str) -> VideoInfo:
    """check_video for a video already open: ``fh`` a seekable binary file object of
    ``size`` bytes, read from where it stands (the caller seeks back to decode from the
    same handle, so the bytes probed are the bytes decoded)."""
    if size > MAX_VIDEO_BYTES:
        raise ArgumentError(f"{where}: {size} bytes, more than a video may have "
                            f"({MAX_VIDEO_BYTES >> 30} GiB)")
    import av

    try:
        with av.open(fh) as container:
            if not container.streams.video:
                raise ArgumentError(f"{where}: holds no video stream")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            if width * height > MAX_IMAGE_PIXELS:
                raise ArgumentError(f"{where}: frames of {width}x{height} pixels, more than "
                                    f"{MAX_IMAGE_PIXELS} (downscale it)")
            rate = stream.average_rate or stream.guessed_rate
            frames = 0
            for packet in container.demux(stream):
                if packet.size:  # the demuxer's last, empty packet flushes the decoder
                    frames += 1
                    if frames > MAX_VIDEO_FRAMES:
                        raise ArgumentError(f"{where}: more than {MAX_VIDEO_FRAMES} frames "
                                            f"(cut it shorter)")
    except ArgumentError:
        raise
    except (av.error.FFmpegError, UnicodeDecodeError, ValueError):
        raise ArgumentError(f"{where}: not a video PyAV can read") from None
    if frames == 0:
        raise ArgumentError(f"{where}: a video of no frames")
    if not rate or float(rate) <= 0:
        raise ArgumentError(f"{where}: its video stream has no frame rate")
    return VideoInfo(frames, float(rate), int(width), int(height))


# ---- bounded JSON -------------------------------------------------------------------------

def json_depth(data) -> int:
    """How deeply the arrays and objects of JSON text ``data`` nest (brackets inside strings
    do not count). Cheap for ordinary text: the exact scan runs only where the text holds
    more opening brackets than the limit could be reached with."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    brackets = _NOT_BRACKET.sub(b"", _STRING.sub(b"", data))
    if not brackets:
        return 0
    import numpy as np

    steps = np.frombuffer(brackets, dtype=np.uint8)
    delta = np.where((steps == ord("[")) | (steps == ord("{")), 1, -1)
    return int(np.cumsum(delta).max())


def check_json_depth(data, where: str, limit: int = MAX_JSON_DEPTH) -> None:
    """ArgumentError if JSON text ``data`` nests deeper than ``limit``."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return  # cannot nest deeper than it opens
    depth = json_depth(raw)
    if depth > limit:
        raise ArgumentError(f"{where}: JSON nested {depth} levels deep; at most {limit} are "
                            f"read")


def loads(text, where: str, limit: int = MAX_JSON_DEPTH) -> Any:
    """json.loads of text from a file or a row, its nesting bounded; ArgumentError naming
    ``where`` for text that is not JSON."""
    check_json_depth(text, where, limit)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as err:
        raise ArgumentError(f"{where}: is not valid JSON ({err})") from None


def load_json(path: str, where: str = "", max_bytes: int = MAX_SMALL_JSON_BYTES,
              limit: int = MAX_JSON_DEPTH) -> Any:
    """The JSON document of regular file ``path``, at most ``max_bytes`` long and nested at
    most ``limit`` deep; ArgumentError naming ``where`` (default: the path) otherwise."""
    where = where or path
    with open_regular(path, "rb", where) as fh:
        raw = fh.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise ArgumentError(f"{where}: is larger than {max_bytes >> 20} MiB; not read as JSON")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ArgumentError(f"{where}: is not UTF-8 text ({err.reason} at byte "
                            f"{err.start})") from None
    return loads(text, where, limit)


def check_json_lines(path: str, where: str, limit: int = MAX_JSON_DEPTH,
                     chunk: int = 8 << 20) -> None:
    """Every line of a JSON (lines) file nests at most ``limit`` deep, checked before a
    parser sees it. Reads the file once; lines with few brackets cost two ``count`` calls
    per chunk, and only a chunk that opens more than ``limit`` brackets is scanned line by
    line. A ``.json`` file holding one document is checked as a whole."""
    with open_regular(path, "rb", where) as fh:
        if fh.read(64).lstrip().startswith(b"["):
            fh.seek(0)
            check_json_depth(fh.read(), where, limit)
            return
        fh.seek(0)
        tail, line_no = b"", 0
        while True:
            block = fh.read(chunk)
            data = tail + block
            if block:
                cut = data.rfind(b"\n") + 1
                data, tail = data[:cut], data[cut:]
            if data.count(b"[") + data.count(b"{") > limit:
                for number, line in enumerate(data.split(b"\n"), line_no + 1):
                    if line.count(b"[") + line.count(b"{") > limit:
                        depth = json_depth(line)
                        if depth > limit:
                            raise ArgumentError(f"{where}: line {number} is JSON nested "
                                                f"{depth} levels deep; at most {limit} are "
                                                f"read")
            line_no += data.count(b"\n")
            if not block:
                return
