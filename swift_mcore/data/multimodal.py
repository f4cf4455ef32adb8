"""Image and video conversation rows checked before any work and encoded for a Qwen VL
model: token ids with each image's and video's pads expanded, answer-only targets, the
patches.

Three row formats are read. ms-swift's: the messages' text holds ``<image>`` / ``<video>``
tags and the ``images`` / ``videos`` columns list one item per tag, in order (an image: a
local path or a ``data:image/...;base64,`` URI; a video: a local video file, or a list of
its frames' image paths). transformers': a message's ``content`` is a list of
``{"type": "text", "text": ...}``, ``{"type": "image", "image"|"path": PATH}`` and
``{"type": "video", "video"|"path": PATH or [FRAME, ...]}`` items; TRL's: content lists
whose ``{"type": "image"}`` items name no file, the ``images`` column holding them in
order. Each becomes one Conversation (the tags in the text) and its images and videos.

Everything a row names is checked when the row is read, before anything is encoded: an
image is a regular file of bounded size that PIL opens as an image of bounded pixels
(input_files.check_image); a video file is a regular file of bounded size whose header
PyAV reads, with 1..MAX_VIDEO_FRAMES frames of bounded pixels (input_files.check_video);
a frame list holds 1..MAX_VIDEO_FRAMES frames, each checked as an image. URLs are refused (nothing is fetched at run time).

Encoding renders the conversation with the text sft's Template (the same answer-only
targets), each tag written as Qwen2.5-VL's chat template writes it
(``<|vision_start|><|image_pad|><|vision_end|>``, ``<|video_pad|>`` for a video); the
folder's image processor decides an image's patches, data/video.py a video's; each pad
becomes ``t * h * w / merge**2`` pads, as transformers' Qwen2.5-VL processor expands it.
Qwen3-VL writes a video as its processor does: per frame group ``<T seconds>`` then the
group's ``<|vision_start|><|video_pad|>...<|vision_end|>``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import ArgumentError
from ..input_files import (
    MAX_IMAGE_BYTES,
    check_image,
    check_image_bytes,
    check_video,
    open_regular,
)
from .conversations import Conversation, to_conversation
from .templates import CONTEXT
from .video import VideoSampling

IMAGE_TAG = "<image>"
# an image given inline in a row (ms-swift accepts base64 images)
BASE64_IMAGE = re.compile(r"^data:image/[\w.+-]+;base64,")
VIDEO_TAG = "<video>"
# the largest ratio of an image's sides Qwen's smart_resize takes (transformers and
# qwen_vl_utils refuse more)
MAX_ASPECT = 200
# Qwen2.5-VL's tokens around and for an image or a video (its chat template and processor)
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
VIDEO_PAD = "<|video_pad|>"
# a batch's video inputs, as the model's forward and transformers' name them
VIDEO_INPUTS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


@dataclass(frozen=True)
class ImageConversation:
    """One row: its conversation (``<image>`` / ``<video>`` tags in the text), the image
    tags' paths and the video tags' videos (a file's path, or a tuple of frame paths),
    with the field each video came from (``videos[0]``, ``messages[0].content[1]``)."""

    conversation: Conversation
    images: Tuple[str, ...]
    videos: Tuple[Any, ...] = ()
    video_fields: Tuple[str, ...] = ()

    @property
    def where(self) -> str:
        return self.conversation.where


def read_image_row(row: Dict[str, Any], where: str) -> ImageConversation:
    """One row in either format -> ImageConversation, every image and video checked.
    ArgumentError naming ``where`` (file and row) and the field for anything that cannot
    be trained."""
    images = _column(row, "images", where)
    images = [_path(value, f"{where}: images[{i}]") for i, value in enumerate(images)]
    videos = [_video(value, f"{where}: videos[{i}]")
              for i, value in enumerate(_column(row, "videos", where))]
    fields = [f"videos[{i}]" for i in range(len(videos))]
    messages = row.get("messages")
    if isinstance(messages, (list, tuple)) and any(
            isinstance(m, dict) and isinstance(m.get("content"), (list, tuple))
            for m in messages):
        column = images
        messages, images, listed = _from_content_lists(messages, where)
        bare = sum(ref is None for ref in images)
        if bare and bare < len(images):
            raise ArgumentError(f"{where}: some image items in the messages' content lists "
                                f"name their image and some do not; give them one way")
        if bare:  # TRL's: {"type": "image"} items, the images in the 'images' column
            images = column
        if (column and not bare and images) or (videos and listed):
            raise ArgumentError(f"{where}: both an 'images'/'videos' column and media items "
                                f"naming their files in the messages' content lists; give "
                                f"them one way")
        if column and not bare:
            images = column + images
        if listed:
            videos, fields = [v for v, _ in listed], [f for _, f in listed]
        row = {**row, "messages": messages}
    conversation = to_conversation(row, where)
    for tag, items, column in ((IMAGE_TAG, images, "images"), (VIDEO_TAG, videos, "videos")):
        tags = 0
        for i, message in enumerate(conversation.messages):
            count = str(message.get("content") or "").count(tag)
            if count and message["role"] == "assistant":
                raise ArgumentError(f"{where}: messages[{i}] (assistant) holds {tag}; "
                                    f"{column} go in the user's (or system's) messages")
            tags += count
        if tags != len(items):
            raise ArgumentError(f"{where}: {tags} {tag} tag(s) in the messages but "
                                f"{len(items)} {column[:-1]}(s) in '{column}' (one per tag, "
                                f"in order)")
    for i, ref in enumerate(images):
        if BASE64_IMAGE.match(ref):
            at = f"{where}: images[{i}]"
            check_aspect(check_image_bytes(_decoded(ref, at), at), at)
        else:
            at = f"{where}: images[{i}] {ref}"
            check_aspect(check_image(ref, at), at)
    for video, field in zip(videos, fields):
        if isinstance(video, tuple):
            for j, frame in enumerate(video):
                check_image(frame, f"{where}: {field}[{j}] {frame}")
        else:
            check_video(video, f"{where}: {field} {video}")
    return ImageConversation(conversation, tuple(images), tuple(videos), tuple(fields))


def _column(row: Dict[str, Any], name: str, where: str) -> List[Any]:
    value = row.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)):
        raise ArgumentError(f"{where}: column '{name}' must be a list of {name[:-1]} paths, "
                            f"got {type(value).__name__} {value!r:.80}")
    return list(value)


def _video(value: Any, where: str):
    """A video item -> its file's path, or a tuple of its frames' image paths."""
    if isinstance(value, dict):  # {"path": ...} / {"video": ...}
        value = value.get("path", value.get("video"))
    if isinstance(value, (list, tuple)):
        if not value:
            raise ArgumentError(f"{where}: an empty list of frames")
        from .. import input_files  # (the bound read when called)

        if len(value) > input_files.MAX_VIDEO_FRAMES:
            raise ArgumentError(f"{where}: a list of {len(value)} frames, more than "
                                f"{input_files.MAX_VIDEO_FRAMES} (cut it shorter)")
        frames = tuple(_path(v, f"{where}[{j}]") for j, v in enumerate(value))
        if any(BASE64_IMAGE.match(f) for f in frames):
            raise ArgumentError(f"{where}: a video's frames are read from image files "
                                f"(not base64)")
        return frames
    if not isinstance(value, str) or not value or "\0" in value:
        raise ArgumentError(f"{where}: {value!r:.80} is not a video path (a video file, or "
                            f"a list of its frames' image paths)")
    if "://" in value or value.startswith("data:"):
        raise ArgumentError(f"{where}: {value:.80} is a URL; swift-mcore reads videos only "
                            f"from local files (nothing is fetched at run time): download "
                            f"it and give its path")
    return os.path.expanduser(value)


def _path(value: Any, where: str) -> str:
    if isinstance(value, dict) and isinstance(value.get("bytes"), (bytes, bytearray)) \
            and value["bytes"]:
        # a datasets Image column's {"bytes", "path"}: the bytes are the image (its path is
        # the file it once came from, maybe another one here); inline, as base64 is
        import base64

        if len(value["bytes"]) > MAX_IMAGE_BYTES:
            raise ArgumentError(f"{where}: {len(value['bytes'])} bytes, more than an image "
                                f"may have ({MAX_IMAGE_BYTES >> 20} MiB)")
        return "data:image/bytes;base64," + base64.b64encode(value["bytes"]).decode()
    if isinstance(value, dict):  # ms-swift's {"path": ...}
        value = value.get("path", value.get("image"))
    if not isinstance(value, str) or not value or "\0" in value:
        raise ArgumentError(f"{where}: {value!r:.80} is not an image path")
    if BASE64_IMAGE.match(value):
        if len(value) > MAX_IMAGE_BYTES * 4 // 3 + 256:
            raise ArgumentError(f"{where}: a base64 image of {len(value)} characters, more "
                                f"than an image may have ({MAX_IMAGE_BYTES >> 20} MiB)")
        return value
    if "://" in value or value.startswith("data:"):
        raise ArgumentError(f"{where}: {value:.80} is a URL; swift-mcore reads images only "
                            f"from local files (nothing is fetched at run time): download "
                            f"it and give its path")
    return os.path.expanduser(value)


def _from_content_lists(messages: Sequence[Any], where: str
                        ) -> Tuple[List[Dict[str, Any]], List[str], List[Tuple[Any, str]]]:
    """transformers' content lists -> text with <image> / <video> tags, the images in
    order, and the videos in order with the field each came from."""
    out, images, videos = [], [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, (list, tuple)):
            out.append(message)
            continue
        text = []
        for j, item in enumerate(content):
            field = f"messages[{i}].content[{j}]"
            at = f"{where}: {field}"
            kind = item.get("type") if isinstance(item, dict) else None
            if kind == "text" and isinstance(item.get("text"), str):
                text.append(item["text"])
            elif kind == "image":
                ref = next((item[k] for k in ("image", "path", "url")
                            if item.get(k) is not None), None)
                # none: TRL's item standing for the next image of the 'images' column
                images.append(None if ref is None else _path(ref, at))
                text.append(IMAGE_TAG)
            elif kind == "video":
                videos.append((_video(item.get("video", item.get("path", item.get("url"))),
                                      at), field))
                text.append(VIDEO_TAG)
            else:
                raise ArgumentError(f"{at}: {item!r:.80} (a {{'type': 'text', 'text': ...}}, "
                                    f"{{'type': 'image', 'image': PATH}} or {{'type': 'video', "
                                    f"'video': PATH}} item)")
        out.append({**message, "content": "".join(text)})
    return out, images, videos


def _decoded(ref: str, where: str) -> bytes:
    import base64
    import binascii

    try:
        return base64.b64decode(ref[BASE64_IMAGE.match(ref).end():], validate=True)
    except (binascii.Error, ValueError):
        raise ArgumentError(f"{where}: a data:image URI whose payload is not valid "
                            f"base64") from None


def load_image(ref: str, where: str, upright: bool = False):
    """The image at path ``ref``, or given inline as a base64 data URI (checked first by
    read_image_row), as RGB; ``upright``: turned as its EXIF orientation says (see
    upright_rgb)."""
    import io

    from PIL import Image

    from PIL import UnidentifiedImageError

    convert = upright_rgb if upright else (lambda image: image.convert("RGB"))
    try:
        if BASE64_IMAGE.match(ref):
            with Image.open(io.BytesIO(_decoded(ref, where))) as image:
                return convert(image)
        with open_regular(ref, "rb", where) as fh:
            with Image.open(fh) as image:
                return convert(image)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        # its header was read when the row was (check_image); its pixels only now
        raise ArgumentError(f"{where}: not an image PIL can read ({e})") from None


def upright_rgb(image):
    """An image (not a video frame) as transformers' processors read a path or a base64
    image (image_utils.load_image): turned by its EXIF orientation, then RGB (a phone's
    portrait JPEG is stored sideways with orientation 6; read as stored, its patches and
    grid would be another image's)."""
    from PIL import ImageOps

    return ImageOps.exif_transpose(image).convert("RGB")


def check_aspect(size: Tuple[int, int], where: str) -> None:
    """ArgumentError for an image whose sides' ratio is over MAX_ASPECT (Qwen's
    smart_resize refuses it deep in the image processor)."""
    width, height = size
    if max(width, height) > MAX_ASPECT * min(width, height):
        raise ArgumentError(f"{where}: {width}x{height} pixels, a side more than "
                            f"{MAX_ASPECT} times the other (Qwen VL image processors refuse "
                            f"it: crop or pad it)")


def load_image_processor(folder: str, flag: str, **sizes):
    """The Qwen VL image processor of the model folder ``folder`` (its
    preprocessor_config.json; ``sizes``: --min_pixels / --max_pixels given), or an
    ArgumentError naming ``flag`` and the file: missing, not JSON, not a Qwen VL image
    processor, or with patch sizes that are not whole numbers."""
    from transformers import AutoImageProcessor

    path = os.path.join(folder, "preprocessor_config.json")
    where = f"{flag} {folder}: preprocessor_config.json"
    if not os.path.isfile(path):
        raise ArgumentError(f"{where} is missing: a vision-language model's folder holds its "
                            f"image processor's settings; copy the file from the model's "
                            f"original folder")
    try:
        processor = AutoImageProcessor.from_pretrained(folder, local_files_only=True, **sizes)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ArgumentError(f"{where}: transformers cannot read it ({error})") from None
    for key in ("patch_size", "merge_size", "temporal_patch_size"):
        value = getattr(processor, key, None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ArgumentError(f"{where}: {key} is {value!r} in a "
                                f"{type(processor).__name__}; a Qwen VL image processor has "
                                f"whole patch_size, merge_size and "
                                f"temporal_patch_size")
    return processor


@dataclass
class EncodedImages:
    """One sample: int32 ids, the tokens trained on, the images' patches and grids, the
    videos' patches, grids and seconds per temporal patch (None without any)."""

    ids: np.ndarray
    targets: np.ndarray
    pixel_values: Any      # torch.Tensor [patches, channels * temporal * patch * patch]
    image_grid_thw: Any    # torch.Tensor [images, 3]
    pixel_values_videos: Any = None  # torch.Tensor [patches, channels * temporal * p * p]
    video_grid_thw: Any = None       # torch.Tensor [videos, 3]
    second_per_grid_ts: Any = None   # torch.Tensor [videos] (float32)

    def media_tokens(self, merge: int) -> int:
        """The pads its images and videos stand for."""
        return sum(int((g.prod(-1) // merge ** 2).sum())
                   for g in (self.image_grid_thw, self.video_grid_thw) if g is not None)


class ImageEncoder:
    """Encodes ImageConversations with a Template, the folder's image processor (images,
    and each video frame's normalization) and the video sampling knobs."""

    def __init__(self, template, image_processor, loss_on: str = "all",
                 sampling: Optional[VideoSampling] = None, timestamps: bool = False):
        self.template = template
        # Qwen3-VL's: each frame group its own pads, after its time in seconds
        self.timestamps = timestamps
        self.last_times: List[List[float]] = []  # the last video_patches' frame group times
        self.image_processor = image_processor
        self.merge = int(image_processor.merge_size)
        self.loss_on = loss_on
        self.sampling = sampling or VideoSampling()
        backend = template.tokenizer.backend
        self.pad_id = backend.token_to_id(IMAGE_PAD)
        self.video_pad_id = backend.token_to_id(VIDEO_PAD)
        if self.pad_id is None or backend.token_to_id(VISION_START) is None:
            raise ArgumentError(f"the tokenizer ({template.tokenizer.source}) has no "
                                f"{IMAGE_PAD} / {VISION_START} token: not a Qwen2.5-VL or "
                                f"Qwen3-VL tokenizer")

    def patches(self, paths: Sequence[str], pictures=None, where: Optional[Sequence[str]] = None):
        """(pixel_values, image_grid_thw) of images read from ``paths`` (``where`` names
        each in errors; default: its path), or of the PIL ``pictures`` given already read
        (the token cache reads each file's bytes once, to hash what it encodes)."""
        images = pictures if pictures is not None else [
            load_image(p, at, upright=True) for p, at in zip(paths, where or paths)]
        out = self.image_processor(images=images, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def video_patches(self, videos: Sequence[Any], where: Sequence[str]):
        """(pixel_values_videos, video_grid_thw, second_per_grid_ts) of videos (a file's
        path or a tuple of frame paths each; or held: a video.HeldVideo, a tuple of
        video.HeldFrame, each opened as it is decoded), sampled and resized by
        data/video.py; ``where`` names each (row and field) in errors."""
        import torch

        from .video import patches, read_frame_list, read_video_file, video_name

        p = self.image_processor
        factor, temporal = int(p.patch_size) * self.merge, int(p.temporal_patch_size)
        pixels, grids, seconds, self.last_times = [], [], [], []
        for video, at in zip(videos, where):
            if isinstance(video, tuple):
                frames = read_frame_list(video, at, self.sampling, factor, temporal,
                                         p.resample, load_image)
            else:
                frames = read_video_file(video, f"{at} {video_name(video)}", self.sampling,
                                         factor, temporal, p.resample)
            one, grid, second = patches(frames, p)
            self.last_times.append(frames.timestamps(temporal))
            pixels.append(one)
            grids.append(grid)
            seconds.append(second)
        return (torch.cat(pixels), torch.tensor(grids),
                torch.tensor(seconds, dtype=torch.float32))

    def media(self, item: ImageConversation, pictures=None, videos=None):
        """(images' (pixel_values, grids) or None, videos' patches or None) of a row;
        ``pictures``: its images already read (PIL), else read from their paths;
        ``videos``: its videos already read (see video_patches), else from their paths."""
        images = self.patches(item.images, pictures, [
            f"{item.where}: images[{i}] {p if not BASE64_IMAGE.match(p) else '(base64)'}"
            for i, p in enumerate(item.images)]) if item.images else None
        videos = self.video_patches(videos or item.videos, [f"{item.where}: {f}"
                                                  for f in item.video_fields]) \
            if item.videos else None
        return images, videos

    def video_text(self, count: int) -> List[str]:
        """The text each of the last ``video_patches`` call's ``count`` videos is written
        as: Qwen2.5-VL's ``<|vision_start|><|video_pad|><|vision_end|>`` (its pad expanded
        later); Qwen3-VL's ``<T seconds><|vision_start|><|video_pad|><|vision_end|>`` per
        frame group (its processor's, T to one decimal)."""
        if not self.timestamps or not count:
            return [VISION_START + VIDEO_PAD + VISION_END] * count
        return ["".join(f"<{t:.1f} seconds>" + VISION_START + VIDEO_PAD + VISION_END
                        for t in times) for times in self.last_times[:count]]

    def encode(self, item: ImageConversation, pictures=None, videos=None) -> EncodedImages:
        """``pictures``: the item's images already read (PIL), else read from its paths;
        ``videos``: its videos already read (see video_patches), else from their paths."""
        from dataclasses import replace

        images, videos = self.media(item, pictures, videos)
        placeholders = iter(self.video_text(len(item.videos)))
        image = VISION_START + IMAGE_PAD + VISION_END
        messages = [{**m, "content": re.sub(re.escape(VIDEO_TAG), lambda _: next(placeholders),
                                            m["content"].replace(IMAGE_TAG, image))}
                    if isinstance(m.get("content"), str) else m
                    for m in item.conversation.messages]
        samples = self.template.encode_samples(replace(item.conversation, messages=messages))
        if len(samples) != 1:
            raise ArgumentError(f"{item.where}: the conversation renders as {len(samples)} "
                                f"samples; a conversation with images must be one")
        ids, turns = samples[0]
        trained = turns == turns.max() if self.loss_on == "last_turn" else turns != CONTEXT
        repeat = np.ones(len(ids), dtype=np.int64)
        for pad, pad_id, grids in ((IMAGE_PAD, self.pad_id, images and images[1]),
                                   (VIDEO_PAD, self.video_pad_id, videos and videos[1])):
            counts = [] if grids is None else (grids.prod(-1) // self.merge ** 2).tolist()
            if pad == VIDEO_PAD and self.timestamps and grids is not None:
                counts = [c // int(t) for c, (t, _, _) in zip(counts, grids.tolist())
                          for _ in range(int(t))]  # one pad per frame group
            at = np.flatnonzero(ids == pad_id) if pad_id is not None else np.zeros(0, int)
            if len(at) != len(counts):
                raise ArgumentError(f"{item.where}: {len(at)} {pad} tokens where "
                                    f"{len(counts)} were written (does the text itself hold "
                                    f"{pad}?)")
            repeat[at] = counts
        return EncodedImages(np.repeat(ids, repeat).astype(np.int32),
                             np.repeat(trained, repeat), *(images or (None, None)),
                             *(videos or (None, None, None)))


# ---- rows of files ------------------------------------------------------------------------

def read_image_conversations(sources, columns: Dict[str, str], flag: str
                             ) -> List[ImageConversation]:
    """Every row of every source, read and checked (images included), in file order."""
    from .sources import read_batches

    out: List[ImageConversation] = []
    for source in sources:
        before = len(out)
        index = 0
        for batch in read_batches(source, flag, batch_size=256):
            names = list(batch)
            for values in zip(*(batch[n] for n in names)):
                row = {columns.get(k, k): v for k, v in zip(names, values)}
                out.append(read_image_row(row, f"{flag} {source.path}, row {index}"))
                index += 1
        if len(out) == before:
            raise ArgumentError(f"{flag} {source.path}: is empty (no rows)")
    return out


def image_prompt(loaded, args, sizes=None):
    """`infer --image` / `--video`: (prompt ids, logits function, end marker, template) of
    a user message showing the image or the video (sampled as --fps, ... say), for a
    loaded vision-language model; ``sizes``: the --min_pixels / --max_pixels a checkpoint
    was trained with."""
    import torch

    from ..models.vision import TIMESTAMP_TYPES
    from .templates import Template

    flag = "--image" if args.image is not None else "--video"
    if not loaded.config.model.vision_config:
        raise ArgumentError(f"{flag}: --model {args.model} is a text model; it needs a "
                            f"vision-language model (a Qwen2.5-VL or Qwen3-VL folder, or its "
                            f"checkpoint)")
    if loaded.hf_folder is None:
        raise ArgumentError(f"{flag}: the image processor of --model {args.model} is not "
                            f"known (its Hugging Face folder is gone)")
    template = Template(args.template, loaded.tokenizer, system=args.system)
    encoder = ImageEncoder(template, load_image_processor(loaded.hf_folder, "--model",
                                                          **(sizes or {})),
                           sampling=VideoSampling.from_args(args),
        timestamps=loaded.config.model.model_type in TIMESTAMP_TYPES)
    path = os.path.expanduser(args.image if flag == "--image" else args.video)
    if flag == "--image":
        pixels, grid = encoder.patches([path], where=[f"--image {args.image}"])
        inputs = {"pixel_values": pixels, "image_grid_thw": grid}
        shown, pad_id = VISION_START + IMAGE_PAD + VISION_END, encoder.pad_id
        counts = [int(grid.prod(-1).sum()) // encoder.merge ** 2]
    else:
        pixels, grid, seconds = encoder.video_patches([path], [f"--video {args.video}"])
        inputs = dict(zip(VIDEO_INPUTS, (pixels, grid, seconds)))
        shown, pad_id = encoder.video_text(1)[0], encoder.video_pad_id
        t, h, w = grid[0].tolist()
        counts = [t * h * w // encoder.merge ** 2] if not encoder.timestamps else \
            [h * w // encoder.merge ** 2] * t
    tag = IMAGE_TAG if flag == "--image" else VIDEO_TAG
    if args.prompt.count(tag) > 1 or (IMAGE_TAG + VIDEO_TAG).replace(tag, "") in args.prompt:
        raise ArgumentError(f"--prompt holds {args.prompt.count(IMAGE_TAG)} {IMAGE_TAG} and "
                            f"{args.prompt.count(VIDEO_TAG)} {VIDEO_TAG} tag(s); {flag} is "
                            f"one {flag[2:]}: at most one {tag} says where it goes")
    content = args.prompt.replace(tag, shown) if tag in args.prompt else shown + args.prompt
    ids = template.prompt([{"role": "user", "content": content}])
    for name, pad in ((IMAGE_PAD, encoder.pad_id), (VIDEO_PAD, encoder.video_pad_id)):
        n = len(counts) if pad == pad_id else 0  # the pads `shown` wrote
        if pad is not None and ids.count(pad) != n:
            raise ArgumentError(f"--prompt/--system write {name} themselves ({ids.count(pad)} "
                                f"in the prompt, {n} from {flag}); write {tag} where the "
                                f"{flag[2:]} goes, not its tokens")
    repeat = [1] * len(ids)
    for at, count in zip([i for i, t in enumerate(ids) if t == pad_id], counts):
        repeat[at] = count
    ids = [t for t, n in zip(ids, repeat) for _ in range(n)]

    @torch.no_grad()
    def logits(tokens):
        device = next(loaded.model.parameters()).device
        return loaded.model(input_ids=tokens.to(device), position_ids=None,
                            attention_mask=None, **{
                                k: v.to(device) if k.startswith("pixel") else v
                                for k, v in inputs.items()}).float()

    return ids, logits, template.end_marker(), template
