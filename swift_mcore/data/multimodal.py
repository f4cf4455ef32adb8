"""Image conversation rows checked before any work and encoded for a Qwen VL model: token
ids with each image's pads expanded, answer-only targets, the images' patches.

Two row formats are read. ms-swift's: the messages' text holds ``<image>`` tags and the
``images`` column lists one local path (or ``data:image/...;base64,`` URI) per tag, in order. transformers': a message's
``content`` is a list of ``{"type": "text", "text": ...}`` and ``{"type": "image",
"image"|"path": PATH}`` items. Either becomes one Conversation (the tags in the text) and
its image paths.

Every image is checked when the row is read, before anything is encoded: a regular file of
bounded size that PIL opens as an image of bounded pixels (input_files.check_image). URLs
are refused (nothing is fetched at run time); so are videos (not supported yet).

Encoding renders the conversation with the text sft's Template (the same answer-only
targets), each tag written as Qwen2.5-VL's chat template writes an image
(``<|vision_start|><|image_pad|><|vision_end|>``); the folder's image processor decides the
patches and each image's pad becomes ``t * h * w / merge**2`` pads, as transformers'
Qwen2.5-VL processor expands it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from ..errors import ArgumentError
from ..input_files import MAX_IMAGE_BYTES, check_image, check_image_bytes, open_regular
from .conversations import Conversation, to_conversation
from .templates import CONTEXT

IMAGE_TAG = "<image>"
# an image given inline in a row (ms-swift accepts base64 images)
BASE64_IMAGE = re.compile(r"^data:image/[\w.+-]+;base64,")
VIDEO_TAG = "<video>"
# Qwen2.5-VL's tokens around and for an image (its chat template and processor)
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"


@dataclass(frozen=True)
class ImageConversation:
    """One row: its conversation (``<image>`` tags in the text) and the tags' image paths."""

    conversation: Conversation
    images: Tuple[str, ...]

    @property
    def where(self) -> str:
        return self.conversation.where


def read_image_row(row: Dict[str, Any], where: str) -> ImageConversation:
    """One row in either format -> ImageConversation, every image checked. ArgumentError
    naming ``where`` (file and row) and the field for anything that cannot be trained."""
    videos = row.get("videos")
    if videos not in (None, [], ()) or VIDEO_TAG in str(row.get("messages") or ""):
        raise ArgumentError(f"{where}: column 'videos' / {VIDEO_TAG} tags: videos are not "
                            f"supported yet (images only)")
    images = row.get("images")
    if images is None:
        images = []
    if isinstance(images, str):
        images = [images]
    if not isinstance(images, (list, tuple)):
        raise ArgumentError(f"{where}: column 'images' must be a list of image paths, got "
                            f"{type(images).__name__} {images!r:.80}")
    images = [_path(value, f"{where}: images[{i}]") for i, value in enumerate(images)]
    messages = row.get("messages")
    if isinstance(messages, (list, tuple)) and any(
            isinstance(m, dict) and isinstance(m.get("content"), (list, tuple))
            for m in messages):
        if images:
            raise ArgumentError(f"{where}: both an 'images' column and image items in the "
                                f"messages' content lists; give the images one way")
        messages, images = _from_content_lists(messages, where)
        row = {**row, "messages": messages}
    conversation = to_conversation(row, where)
    tags = 0
    for i, message in enumerate(conversation.messages):
        count = str(message.get("content") or "").count(IMAGE_TAG)
        if count and message["role"] == "assistant":
            raise ArgumentError(f"{where}: messages[{i}] (assistant) holds {IMAGE_TAG}; "
                                f"images go in the user's (or system's) messages")
        tags += count
    if tags != len(images):
        raise ArgumentError(f"{where}: {tags} {IMAGE_TAG} tag(s) in the messages but "
                            f"{len(images)} image(s) in 'images' (one path per tag, in order)")
    for i, ref in enumerate(images):
        if BASE64_IMAGE.match(ref):
            check_image_bytes(_decoded(ref, f"{where}: images[{i}]"), f"{where}: images[{i}]")
        else:
            check_image(ref, f"{where}: images[{i}] {ref}")
    return ImageConversation(conversation, tuple(images))


def _path(value: Any, where: str) -> str:
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
                        ) -> Tuple[List[Dict[str, Any]], List[str]]:
    """transformers' content lists -> text with <image> tags, and the images in order."""
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, (list, tuple)):
            out.append(message)
            continue
        text = []
        for j, item in enumerate(content):
            at = f"{where}: messages[{i}].content[{j}]"
            kind = item.get("type") if isinstance(item, dict) else None
            if kind == "text" and isinstance(item.get("text"), str):
                text.append(item["text"])
            elif kind == "image":
                images.append(_path(item.get("image", item.get("path", item.get("url"))), at))
                text.append(IMAGE_TAG)
            else:
                raise ArgumentError(f"{at}: {item!r:.80} (a {{'type': 'text', 'text': ...}} "
                                    f"or {{'type': 'image', 'image': PATH}} item)")
        out.append({**message, "content": "".join(text)})
    return out, images


def _decoded(ref: str, where: str) -> bytes:
    import base64
    import binascii

    try:
        return base64.b64decode(ref[BASE64_IMAGE.match(ref).end():], validate=True)
    except (binascii.Error, ValueError):
        raise ArgumentError(f"{where}: a data:image URI whose payload is not valid "
                            f"base64") from None


def load_image(ref: str, where: str):
    """The image at path ``ref``, or given inline as a base64 data URI (checked first by
    read_image_row), as RGB."""
    import io

    from PIL import Image

    if BASE64_IMAGE.match(ref):
        with Image.open(io.BytesIO(_decoded(ref, where))) as image:
            return image.convert("RGB")
    with open_regular(ref, "rb", where) as fh:
        with Image.open(fh) as image:
            return image.convert("RGB")


@dataclass
class EncodedImages:
    """One sample: int32 ids, the tokens trained on, the images' patches and grids."""

    ids: np.ndarray
    targets: np.ndarray
    pixel_values: Any      # torch.Tensor [patches, channels * temporal * patch * patch]
    image_grid_thw: Any    # torch.Tensor [images, 3]


class ImageEncoder:
    """Encodes ImageConversations with a Template and the folder's image processor."""

    def __init__(self, template, image_processor, loss_on: str = "all"):
        self.template = template
        self.image_processor = image_processor
        self.merge = int(image_processor.merge_size)
        self.loss_on = loss_on
        backend = template.tokenizer.backend
        self.pad_id = backend.token_to_id(IMAGE_PAD)
        if self.pad_id is None or backend.token_to_id(VISION_START) is None:
            raise ArgumentError(f"the tokenizer ({template.tokenizer.source}) has no "
                                f"{IMAGE_PAD} / {VISION_START} token: not a Qwen2.5-VL or "
                                f"Qwen3-VL tokenizer")

    def patches(self, paths: Sequence[str], pictures=None):
        """(pixel_values, image_grid_thw) of images read from ``paths``, or of the PIL
        ``pictures`` given already read (the token cache reads each file's bytes once, to
        hash what it encodes)."""
        images = pictures if pictures is not None else [load_image(p, p) for p in paths]
        out = self.image_processor(images=images, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def encode(self, item: ImageConversation, pictures=None) -> EncodedImages:
        """``pictures``: the item's images already read (PIL), else read from its paths."""
        from dataclasses import replace

        placeholder = VISION_START + IMAGE_PAD + VISION_END
        messages = [{**m, "content": m["content"].replace(IMAGE_TAG, placeholder)}
                    if isinstance(m.get("content"), str) else m
                    for m in item.conversation.messages]
        samples = self.template.encode_samples(replace(item.conversation, messages=messages))
        if len(samples) != 1:
            raise ArgumentError(f"{item.where}: the conversation renders as {len(samples)} "
                                f"samples; a conversation with images must be one")
        ids, turns = samples[0]
        trained = turns == turns.max() if self.loss_on == "last_turn" else turns != CONTEXT
        pads = np.flatnonzero(ids == self.pad_id)
        if len(pads) != len(item.images):
            raise ArgumentError(f"{item.where}: {len(pads)} {IMAGE_PAD} tokens for "
                                f"{len(item.images)} images (does the text itself hold "
                                f"{IMAGE_PAD}?)")
        if item.images:
            pixels, grids = self.patches(item.images, pictures)
            counts = (grids.prod(-1) // self.merge ** 2).tolist()
        else:
            pixels, grids, counts = None, None, []
        repeat = np.ones(len(ids), dtype=np.int64)
        repeat[pads] = counts
        return EncodedImages(np.repeat(ids, repeat).astype(np.int32),
                             np.repeat(trained, repeat), pixels, grids)


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


def image_prompt(loaded, args):
    """`infer --image`: (prompt ids, logits function, end marker, template) of a user
    message showing the image, for a loaded vision-language model."""
    import torch
    from transformers import AutoImageProcessor

    from .templates import Template

    if not loaded.config.model.vision_config:
        raise ArgumentError(f"--image: --model {args.model} is a text model; images need a "
                            f"vision-language model (a Qwen2.5-VL or Qwen3-VL folder, or its "
                            f"checkpoint)")
    if loaded.hf_folder is None:
        raise ArgumentError(f"--image: the image processor of --model {args.model} is not "
                            f"known (its Hugging Face folder is gone)")
    template = Template(args.template, loaded.tokenizer, system=args.system)
    encoder = ImageEncoder(template, AutoImageProcessor.from_pretrained(
        loaded.hf_folder, local_files_only=True))
    path = os.path.expanduser(args.image)
    ids = template.prompt([{"role": "user", "content": VISION_START + IMAGE_PAD + VISION_END
                            + args.prompt}])
    pixels, grid = encoder.patches([path])
    count = int(grid.prod(-1).sum()) // encoder.merge ** 2
    at = ids.index(encoder.pad_id)
    ids = ids[:at] + [encoder.pad_id] * count + ids[at + 1:]

    @torch.no_grad()
    def logits(tokens):
        device = next(loaded.model.parameters()).device
        return loaded.model(input_ids=tokens.to(device), position_ids=None,
                            attention_mask=None, pixel_values=pixels.to(device),
                            image_grid_thw=grid).float()

    return ids, logits, template.end_marker(), template
