"""Qwen2.5-VL and Qwen3-VL as one megatron model: megatron-core's GPTModel with multimodal
RoPE for the language model, the folder's own transformers vision tower (and merger) inside it.

The language model is Qwen2's (q/k/v bias, SwiGLU, RMSNorm) with RoPE over three position
rows (temporal, height, width: megatron's ``mrope`` with ``mrope_section``). The vision
tower is transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` built from config.json's
``vision_config`` (as mcore-bridge keeps it): its merged patch features replace the token
embeddings at the image-pad positions before the first decoder layer. Its parameters are
the model's (``visual.*``, the names the Hugging Face files use), so one optimizer and one
checkpoint hold both.

Position ids are computed as transformers' ``Qwen2_5_VLModel.get_rope_index`` does for
images: text tokens count up on all three rows; an image of ``t x h x w`` merged patches
starting at position p gets rows p + (t index, h index, w index), and the text after it
continues at p + max(h, w). A packed row's samples each start again at 0.

Qwen3-VL differs in three ways: its language model is Qwen3's (RMSNorm on each query and
key head); its RoPE interleaves the three rows over the channel pairs (pair i takes the
height row when i % 3 == 1 and i < 3 * mrope_section[1], the width row when i % 3 == 2 and
i < 3 * mrope_section[2], else the temporal row) where Qwen2.5-VL gives each row one
contiguous block; and its tower's ``deepstack_merger_list`` turns the output of some tower
blocks into features added to the image-pad positions' hidden states after the first
decoder layers (layer i gets the i-th), as transformers' Qwen3VLTextModel does.

Under sequence parallelism the tower (whole on every rank) sees the whole sequence's
images: their features enter the whole embeddings, which are then split along the sequence
as megatron's embedding splits them; each deepstack layer adds its rank's part. Under
context parallelism likewise: the model gets whole rows (the trainer keeps them), computes
the three position rows and the embeddings whole, and keeps this rank's two of megatron's
2 x CP chunks of the embeddings and deepstack features (the RoPE takes its chunks of the
whole positions, as megatron's does). With pipeline stages the tower and its mergers are
the first stage's (its parameters are only there), as are the deepstack layers
(RunArguments.check_deepstack_stage); every stage computes the position rows from the
batch's tokens and grids.

A Qwen2.5-VL video (``pixel_values_videos``, ``video_grid_thw``) goes through the same
tower apart from the images; its features replace the video-pad embeddings, and its
temporal position rows step by ``tokens_per_second * second_per_grid_ts`` per frame group
(truncated to integers), as transformers' get_rope_index computes them.

Qwen3-VL's videos: timestamps (text) part a video's frame groups, so each group is its own
``1 x h x w`` grid in the positions (as transformers' get_rope_index splits
``video_grid_thw``), and the deepstack features of the images and videos are added at
their pads together, in the sequence's order.

Not yet here (issue 42): the interleaved pipeline schedule (RunArguments.check_vision
refuses it).
"""

from __future__ import annotations

import collections
import functools
import json
from dataclasses import dataclass
from typing import Any, Deque, Dict, Iterator, List, Optional, Tuple

import torch

from .families.base import UnsupportedConfig

VISION_PREFIX = "visual."
# config.json keys of a Qwen2.5-VL folder besides text_config / vision_config
TOP_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
# the model_types built here (families/qwen2_5_vl.py, qwen3_vl.py, qwen3_vl_moe.py)
VL_TYPES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
# those whose prompts give each video frame group its time (data/multimodal.py)
TIMESTAMP_TYPES = ("qwen3_vl", "qwen3_vl_moe")
# Qwen3-VL's files name the language model model.language_model.* and the tower
# model.visual.* (Qwen2.5-VL's: model.* and visual.*)
NESTED_NAMES = frozenset({"qwen3_vl", "qwen3_vl_moe"})


@dataclass(frozen=True)
class VisionLanguage:
    """What a Qwen2.5-VL config.json adds to its language model."""

    vision_config: Dict[str, Any]   # config.json's vision_config, as written there
    image_token_id: int
    video_token_id: Optional[int]
    mrope_section: Tuple[int, ...]  # RoPE channel pairs of the temporal, height, width rows
    spatial_merge_size: int
    hidden_size: int                # the language model's (the merger's output)
    token_ids: Tuple[Tuple[str, Any], ...] = ()  # config.json's TOP_KEYS, as written there
    model_type: str = "qwen2_5_vl"  # one of VL_TYPES

    @property
    def tokens_per_second(self) -> int:
        """Qwen2.5-VL's temporal position step per second of video (vision_config's;
        transformers' default 4)."""
        return int(self.vision_config.get("tokens_per_second", 4))

    @property
    def interleaved(self) -> bool:
        """Whether the RoPE rows interleave over the channel pairs (Qwen3-VL's)."""
        return self.model_type in ("qwen3_vl", "qwen3_vl_moe")

    @classmethod
    def from_hf_config(cls, config: Dict[str, Any]) -> "VisionLanguage":
        """Raises UnsupportedConfig naming the key(s) that do not describe a Qwen2.5-VL model
        swift-mcore builds exactly."""
        problems: List[str] = []
        if config.get("model_type") not in VL_TYPES:
            problems.append(f"model_type {config.get('model_type')!r} (one of "
                            f"{', '.join(VL_TYPES)})")
        text = language_config(config)
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            raise UnsupportedConfig(f"vision_config {vision!r} (an object: the vision tower)")
        image = config.get("image_token_id")
        vocab = text.get("vocab_size")
        if isinstance(image, bool) or not isinstance(image, int) or not isinstance(vocab, int) \
                or not 0 <= image < vocab:
            problems.append(f"image_token_id {image!r} (a token id below vocab_size {vocab!r})")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        section = rope.get("mrope_section") if isinstance(rope, dict) else None
        heads = text.get("num_attention_heads") or 1
        head_dim = text.get("head_dim") or (text.get("hidden_size") or 0) // heads
        if not (isinstance(section, list) and len(section) == 3
                and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                        for s in section) and sum(section) * 2 == head_dim):
            problems.append(f"text_config.rope_parameters.mrope_section {section!r} (three "
                            f"channel-pair counts summing to head_dim / 2 = {head_dim // 2})")
        merge = vision.get("spatial_merge_size", 2)
        out = vision.get("out_hidden_size")
        if out is not None and out != text.get("hidden_size"):
            problems.append(f"vision_config.out_hidden_size {out!r} (the language model's "
                            f"hidden_size {text.get('hidden_size')!r})")
        if not isinstance(merge, int) or isinstance(merge, bool) or merge < 1:
            problems.append(f"vision_config.spatial_merge_size {merge!r} (an integer >= 1)")
        deepstack = vision.get("deepstack_visual_indexes", [])
        depth = vision.get("depth")
        if not (isinstance(deepstack, list) and all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0
                and (not isinstance(depth, int) or i < depth) for i in deepstack)):
            problems.append(f"vision_config.deepstack_visual_indexes {deepstack!r} (indexes of "
                            f"the tower's {depth!r} blocks)")
        if problems:
            raise UnsupportedConfig("; ".join(problems))
        return cls(vision_config=dict(vision), image_token_id=int(image),
                   video_token_id=config.get("video_token_id"),
                   mrope_section=tuple(section), spatial_merge_size=int(merge),
                   hidden_size=int(text["hidden_size"]),
                   token_ids=tuple((k, config[k]) for k in TOP_KEYS if k in config),
                   model_type=config["model_type"])

    def flags(self) -> Dict[str, str]:
        """The ModelArguments values that carry this (saved with every checkpoint)."""
        vision = {"vision_config": self.vision_config, **dict(self.token_ids)}
        return {"mrope_section": json.dumps(list(self.mrope_section), separators=(",", ":")),
                "vision_config": json.dumps(vision, sort_keys=True, separators=(",", ":"))}

    @classmethod
    def from_model_args(cls, m: Any) -> "VisionLanguage":
        """From --vision_config and --mrope_section (checked by RunArguments.check_vision)."""
        vision = json.loads(m.vision_config)
        kind = m.model_type if m.model_type in VL_TYPES else "qwen2_5_vl"
        return cls.from_hf_config({
            "model_type": kind, **{k: v for k, v in vision.items() if k in TOP_KEYS},
            "vision_config": vision["vision_config"],
            "text_config": {"hidden_size": m.hidden_size, "vocab_size": m.vocab_size or 2 ** 31,
                            "num_attention_heads": m.num_attention_heads,
                            "head_dim": m.kv_channels or m.hidden_size // m.num_attention_heads,
                            "rope_parameters": {"mrope_section": json.loads(m.mrope_section)}}})

    def hf_keys(self) -> Dict[str, Any]:
        """config.json's keys of the vision side (vision_config and the token ids)."""
        return {"vision_config": dict(self.vision_config), **dict(self.token_ids)}

    def tokens_per_image(self, grid_thw: torch.Tensor) -> List[int]:
        """Image-pad tokens each image of ``grid_thw`` ([images, 3] patches) stands for."""
        return (grid_thw.prod(-1) // self.spatial_merge_size ** 2).tolist()


def language_config(config: Dict[str, Any]) -> Dict[str, Any]:
    """The language model of a Qwen2.5-VL (Qwen3-VL) config.json as a Qwen2 (Qwen3)
    config.json: text_config
    (older folders keep its keys at the top level) with the top-level tie_word_embeddings."""
    text = config.get("text_config")
    if text is None:
        text = {k: v for k, v in config.items() if k not in ("vision_config", *TOP_KEYS)}
    out = dict(text)
    if "tie_word_embeddings" in config:
        out["tie_word_embeddings"] = config["tie_word_embeddings"]
    return out


def language_values(config: Dict[str, Any], model_args: Any = None) -> Dict[str, Any]:
    """The ModelArguments values of the language model (the text family of the folder's
    vision-language family reads it: its defaults, checks and refusals); raises
    UnsupportedConfig naming the key."""
    from .families import by_name

    family = by_name(config.get("model_type") or "qwen2_5_vl")
    return family.text().model_values(language_config(config), model_args)


# ---- 3-D position ids --------------------------------------------------------------------

def _runs(kinds: List[int], breaks=frozenset()) -> Iterator[Tuple[int, int, int]]:
    """(kind, start, end) of each run of equal kind (0 text, 1 image pad, 2 video pad) in
    ``kinds``; a run also ends before each index in ``breaks``."""
    start = 0
    for i in range(1, len(kinds) + 1):
        if i == len(kinds) or i in breaks or kinds[i] != kinds[start]:
            yield kinds[start], start, i
            start = i


def rope_index(input_ids: torch.Tensor, image_grid_thw: Optional[torch.Tensor],
               vl: VisionLanguage, text_positions: Optional[torch.Tensor] = None,
               video_grid_thw: Optional[torch.Tensor] = None,
               second_per_grid_ts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Position ids [3, batch, sequence] of ``input_ids`` (images in ``image_grid_thw``
    order and videos in ``video_grid_thw`` order, row by row). A run of pad tokens may
    hold several images (videos) back to back; each takes its own grid's share. A video's
    temporal rows step by ``tokens_per_second * second_per_grid_ts`` per temporal patch
    (truncated to integers, as transformers' get_rope_index; 1 second when not given).
    ``text_positions`` [batch, sequence] (a packed row's positions) start a new sample
    wherever they are 0: positions restart there. Raises ValueError when the pads and
    grids disagree."""
    batch, length = input_ids.shape
    out = torch.zeros(3, batch, length, dtype=torch.long)
    kinds = torch.zeros_like(input_ids, dtype=torch.long)
    kinds[input_ids == vl.image_token_id] = 1
    if vl.video_token_id is not None:
        kinds[input_ids == vl.video_token_id] = 2
    if vl.interleaved and video_grid_thw is not None:
        # Qwen3-VL: timestamps (text) part a video's frame groups, each its own 1 x h x w
        video_grid_thw = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)
        video_grid_thw[:, 0] = 1
    grids = {1: image_grid_thw.tolist() if image_grid_thw is not None else [],
             2: video_grid_thw.tolist() if video_grid_thw is not None else []}
    counts = {k: [t * h * w // vl.spatial_merge_size ** 2 for t, h, w in g]
              for k, g in grids.items()}
    # on the CPU, as the positions are built (the batch may sit on the GPU)
    second_per_grid_ts = torch.ones(len(grids[2])) if second_per_grid_ts is None \
        else second_per_grid_ts.detach().cpu()
    taken = {1: 0, 2: 0}
    names = {1: "image", 2: "video"}
    for b in range(batch):
        starts = set() if text_positions is None else set(
            torch.nonzero(text_positions[b] == 0).flatten().tolist())
        position = 0
        for kind, start, end in _runs(kinds[b].tolist(), starts):
            if start in starts:
                position = 0
            if not kind:
                out[:, b, start:end] = torch.arange(position, position + end - start)
                position += end - start
                continue
            at = start
            while at < end:
                index = taken[kind]
                if index >= len(grids[kind]) or at + counts[kind][index] > end:
                    raise ValueError(f"row {b}: {names[kind]}-pad tokens at {start}..{end} "
                                     f"do not match the {names[kind]}s' grids {grids[kind]}")
                t, h, w = grids[kind][index]
                h, w = h // vl.spatial_merge_size, w // vl.spatial_merge_size
                steps = torch.arange(t)
                if kind == 2:  # float32 products, truncated: transformers' arithmetic
                    steps = (steps * (vl.tokens_per_second
                                      * second_per_grid_ts[index].float())).long()
                rows = torch.stack(torch.meshgrid(steps, torch.arange(h), torch.arange(w),
                                                  indexing="ij")).reshape(3, -1)
                out[:, b, at: at + counts[kind][index]] = rows + position
                position += max(h, w)
                at += counts[kind][index]
                taken[kind] += 1
    for kind in (1, 2):
        if taken[kind] != len(grids[kind]):
            raise ValueError(f"{len(grids[kind])} {names[kind]}s but {names[kind]}-pad tokens "
                             f"for {taken[kind]}")
    return out.to(input_ids.device)


# ---- the model ---------------------------------------------------------------------------

def build_vision_tower(vl: VisionLanguage, dtype: torch.dtype = torch.float32):
    """transformers' Qwen2.5-VL (Qwen3-VL) vision tower and merger(s) for
    ``vl.vision_config`` (random weights: the caller loads the folder's)."""
    if vl.model_type == "qwen3_vl":
        from transformers.models.qwen3_vl.configuration_qwen3_vl import (
            Qwen3VLVisionConfig as Config,
        )
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as Tower
    elif vl.model_type == "qwen3_vl_moe":
        from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import (
            Qwen3VLMoeVisionConfig as Config,
        )
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
            Qwen3VLMoeVisionModel as Tower,
        )
    else:
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (
            Qwen2_5_VLVisionConfig as Config,
        )
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as Tower,
        )

    config = Config(**{k: v for k, v in vl.vision_config.items() if k != "model_type"})
    tower = Tower._from_config(config, attn_implementation="sdpa", dtype=dtype)
    return tower.to(dtype)


@functools.lru_cache(maxsize=None)
def _interleaved_rope_class():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        MultimodalRotaryEmbedding,
    )

    class InterleavedMultimodalRotaryEmbedding(MultimodalRotaryEmbedding):
        """megatron's multimodal RoPE with Qwen3-VL's layout of the three rows over the
        channel pairs (the module docstring says which pair takes which row)."""

        def forward(self, position_ids, mrope_section, cp_group=None):
            angles = position_ids.to(self.inv_freq.device).float()[..., None] * self.inv_freq
            pairs = angles[0].clone()  # [batch, sequence, pairs]: the temporal row
            for row in (1, 2):
                picked = slice(row, 3 * mrope_section[row], 3)
                pairs[..., picked] = angles[row][..., picked]
            emb = torch.cat((pairs, pairs), dim=-1)
            emb = emb[..., None, :].transpose(0, 1).contiguous()  # [sequence, batch, 1, dim]
            cp_group = cp_group if cp_group is not None else self.cp_group
            if cp_group is not None and cp_group.size() > 1:
                # the positions are the whole sequence's: this rank's chunks, as megatron's
                from megatron.core.models.common.embeddings.rotary_pos_embedding import (
                    get_pos_emb_on_this_cp_rank,
                )

                emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
            return emb

    return InterleavedMultimodalRotaryEmbedding


class _JoinDeepstack(torch.autograd.Function):
    """The embeddings unchanged forward; backward, the gradients the decoder layers left on
    the deepstack features' stand-in leaves go to the features themselves, in the same
    backward pass as the embeddings' (the layers' backward, recomputed or not, comes first:
    the embeddings feed the first layer)."""

    @staticmethod
    def forward(ctx, embedded, leaves, *features):
        ctx.leaves = leaves
        return embedded.view_as(embedded)

    @staticmethod
    def backward(ctx, grad):
        sent = tuple(None if not leaf.requires_grad
                     else leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                     for leaf in ctx.leaves)
        ctx.leaves = None
        return (grad, None, *sent)


def on_this_cp_rank(rows: torch.Tensor, cp: int) -> torch.Tensor:
    """This context-parallel rank's part of ``rows`` [batch, sequence, ...]: chunks r and
    2CP-1-r of 2CP, megatron's causal balance (``get_batch_on_this_cp_rank``)."""
    if cp == 1:
        return rows
    from megatron.core.utils import get_batch_on_this_cp_rank

    return get_batch_on_this_cp_rank({"rows": rows})["rows"]


def _model_class():
    from megatron.core.models.gpt import GPTModel

    class VisionLanguageModel(GPTModel):
        """GPTModel whose first stage embeds images: the vision tower's features replace the
        image-pad tokens' embeddings; positions are the three mrope rows."""

        def __init__(self, vl: VisionLanguage, **kwargs):
            super().__init__(position_embedding_type="mrope", **kwargs)
            self.vl = vl
            if vl.interleaved:
                self.rotary_pos_emb = _interleaved_rope_class()(
                    kv_channels=self.config.kv_channels,
                    rotary_percent=kwargs.get("rotary_percent", 1.0),
                    rotary_base=kwargs.get("rotary_base", 10000))
            self._deepstack = None  # (image-pad mask, features per layer) of this forward
            self._in_forward = self._record = False
            # Under --recompute_granularity full a layer runs again in the backward, after
            # the forward of later micro-batches (pipeline schedules): each layer keeps the
            # features of the micro-batches whose backward is still to come, in order.
            self._pending: Dict[int, Deque] = {}
            if self.pre_process:
                self.visual = build_vision_tower(vl, self.config.params_dtype)
                mergers = len(getattr(self.visual, "deepstack_merger_list", ()))
                # a hook on the layer, not a copy of megatron's block loop: it runs inside
                # activation recompute too
                for i, layer in enumerate(self.decoder.layers[:mergers]):
                    self._pending[i] = collections.deque()
                    layer.register_forward_hook(self._deepstack_hook(i))

        def _recomputed(self) -> bool:
            """Whether this forward's layers run again in the backward (megatron recomputes
            whole layers when training with --recompute_granularity full)."""
            return (self.training and torch.is_grad_enabled()
                    and self.config.recompute_granularity == "full")

        def _deepstack_hook(self, index):
            def add_features(module, args, output):
                if self._in_forward:
                    deepstack = self._deepstack
                    if self._record and not torch.is_grad_enabled():
                        # inside megatron's checkpoint: this layer runs again in the backward
                        self._pending[index].append(deepstack)
                else:  # the recompute in the backward: the oldest micro-batch's features
                    deepstack = self._pending[index].popleft() if self._pending[index] \
                        else None
                if deepstack is None:
                    return output
                mask, features = deepstack
                hidden, context = output
                rows = hidden.new_zeros(*mask.shape, hidden.shape[-1]).masked_scatter(
                    mask.unsqueeze(-1), features[index].to(hidden.dtype))
                rows = on_this_cp_rank(rows, self.config.context_parallel_size).transpose(0, 1)
                if self.config.sequence_parallel:
                    # this rank's part of the sequence; backward, the whole features'
                    # gradient on every rank (the tower is whole on each)
                    from megatron.core import tensor_parallel

                    rows = tensor_parallel.scatter_to_sequence_parallel_region(rows)
                return hidden + rows, context
            return add_features

        def forward(self, input_ids, position_ids, attention_mask, decoder_input=None,
                    labels=None, pixel_values=None, image_grid_thw=None,
                    pixel_values_videos=None, video_grid_thw=None, second_per_grid_ts=None,
                    **kwargs):
            media = pixel_values is not None or pixel_values_videos is not None
            if position_ids is not None and position_ids.dim() == 2 and not media:
                # text alone: the three rows are the text positions (packed rows restart)
                position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
            elif position_ids is None or position_ids.dim() == 2:
                # each sample's (a packed row's samples restart at text position 0)
                position_ids = rope_index(input_ids, image_grid_thw, self.vl, position_ids,
                                          video_grid_thw, second_per_grid_ts)
            self._deepstack = None
            # (the hooks' first run is inside megatron's checkpoint, without grad: asked here)
            self._in_forward, self._record = True, self._recomputed()
            try:
                return self._forward(input_ids, position_ids, attention_mask, decoder_input,
                                     labels, pixel_values, image_grid_thw,
                                     pixel_values_videos, video_grid_thw, **kwargs)
            finally:
                self._in_forward = False

        def _forward(self, input_ids, position_ids, attention_mask, decoder_input, labels,
                     pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw,
                     **kwargs):
            if decoder_input is None and self.pre_process:
                decoder_input = self.embedding(input_ids=input_ids, position_ids=None)
                if pixel_values is not None or pixel_values_videos is not None:
                    decoder_input = self._with_media(input_ids, decoder_input, pixel_values,
                                                     image_grid_thw, pixel_values_videos,
                                                     video_grid_thw)
                if self.config.context_parallel_size > 1:
                    # the whole row embedded, the media at their pads: this rank's chunks
                    decoder_input = on_this_cp_rank(
                        decoder_input.transpose(0, 1), self.config.context_parallel_size
                    ).transpose(0, 1).contiguous()
                if self.config.sequence_parallel:
                    # the embedding leaves the sequence whole (build_vl_model) so that the
                    # image features land at their pads; split as megatron's embedding does
                    from megatron.core import tensor_parallel

                    decoder_input = tensor_parallel.scatter_to_sequence_parallel_region(
                        decoder_input)
            return super().forward(input_ids, position_ids, attention_mask,
                                   decoder_input=decoder_input, labels=labels, **kwargs)

        def _features(self, pixels, grid_thw, token_id, what, input_ids):
            """(the tower's features, its deepstack features, the pads' mask) of images or
            videos (the tower runs on each kind apart, as transformers does)."""
            if token_id is None:
                raise ValueError(f"{what}s given, but the model has no {what} token id")
            out = self.visual(pixels.to(self.config.params_dtype), grid_thw=grid_thw)
            mask = input_ids == token_id
            if int(mask.sum()) != out.pooler_output.shape[0]:
                raise ValueError(f"{int(mask.sum())} {what}-pad tokens but "
                                 f"{out.pooler_output.shape[0]} {what} features "
                                 f"({what}_grid_thw {grid_thw.tolist()})")
            return out.pooler_output, list(getattr(out, "deepstack_features", None) or ()), mask

        def _with_media(self, input_ids, embedded, pixel_values, image_grid_thw,
                        pixel_values_videos, video_grid_thw):
            """[sequence, batch, hidden] embeddings with the image and video features at
            their pads, in the rows' order (row 0's first, as transformers fills them); for
            Qwen3-VL, the deepstack features of both at their pads together."""
            parts = []
            if pixel_values is not None:
                parts.append(self._features(pixel_values, image_grid_thw,
                                            self.vl.image_token_id, "image", input_ids))
            if pixel_values_videos is not None:
                parts.append(self._features(pixel_values_videos, video_grid_thw,
                                            self.vl.video_token_id, "video", input_ids))
            rows = embedded.transpose(0, 1)
            for features, _, mask in parts:
                rows = rows.masked_scatter(mask.unsqueeze(-1), features.to(rows.dtype))
            embedded = rows.transpose(0, 1).contiguous()
            if not parts[0][1]:
                return embedded
            mask = parts[0][2] if len(parts) == 1 else parts[0][2] | parts[1][2]
            if len(parts) == 1:
                deepstack = parts[0][1]
            else:  # both kinds: each layer's features at the image or video pads in order
                deepstack = []
                for image, video in zip(parts[0][1], parts[1][1]):
                    joint = image.new_zeros(int(mask.sum()), image.shape[-1])
                    joint = joint.index_put((torch.nonzero(parts[0][2][mask]).flatten(),),
                                            image)
                    joint = joint.index_put((torch.nonzero(parts[1][2][mask]).flatten(),),
                                            video)
                    deepstack.append(joint)
            if torch.is_grad_enabled() and any(f.requires_grad for f in deepstack):
                # A recomputed layer (--recompute_granularity full) runs its own backward on
                # what it used: fed the tower's features themselves, that backward would
                # run through the tower, whose graph the main backward runs through again.
                # The layers get leaves instead; their gradients join the tower's at the
                # embeddings, after every layer's backward.
                leaves = [f.detach().requires_grad_(f.requires_grad) for f in deepstack]
                embedded = _JoinDeepstack.apply(embedded, leaves, *deepstack)
                deepstack = leaves
            self._deepstack = (mask, deepstack)
            return embedded

    return VisionLanguageModel


def build_vl_model(config, vl: VisionLanguage, tc, spec):
    """This rank's Qwen2.5-VL / Qwen3-VL model (one chunk) for a RunConfig, its
    TransformerConfig and decoder block spec (models/gpt.py makes both). The tower sits on
    the first pipeline stage (the first model chunk of the interleaved schedule). Under
    --sequence_parallel the embedding keeps the whole sequence: the image features enter
    it, then the forward splits it along the sequence."""
    from megatron.core import parallel_state

    m = config.model
    tc.mrope_section = list(vl.mrope_section)
    model = _model_class()(
        vl,
        config=tc,
        transformer_layer_spec=spec,
        vocab_size=config.padded_vocab_size,
        max_sequence_length=m.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        rotary_percent=m.rotary_percent,
        rotary_base=m.rotary_base,
        scatter_embedding_sequence_parallel=False,
    )
    if config.cuda:
        model.cuda(torch.cuda.current_device())
    return model


def precision_inputs(vl: VisionLanguage, tokens: torch.Tensor, generator: torch.Generator
                     ) -> Dict[str, torch.Tensor]:
    """Random ``tokens`` [batch, length] with one random image of 4 merged patches in each
    row (after two tokens) and, for Qwen2.5-VL with room for it (Qwen3-VL's frame groups
    would need timestamps between them), a random video of 2
    temporal patches of 4 merged patches after the image (1.25 seconds each): the inputs
    export's --test_convert_precision feeds both models."""
    merge, v = vl.spatial_merge_size, vl.vision_config
    grid = [1, 2 * merge, 2 * merge]
    count = 4
    ids = tokens.clone()
    ids[ids == vl.image_token_id] = 0
    ids[:, 2: 2 + count] = vl.image_token_id
    patch = int(v.get("patch_size", 14))
    width = int(v.get("in_channels", 3)) * int(v.get("temporal_patch_size", 2)) * patch * patch
    pixels = torch.randn(ids.shape[0] * grid[1] * grid[2], width, generator=generator)
    out = {"input_ids": ids, "pixel_values": pixels,
           "image_grid_thw": torch.tensor([grid] * ids.shape[0])}
    video = [2, 2 * merge, 2 * merge]
    start, frames = 2 + count + 1, 2 * count
    if vl.model_type not in TIMESTAMP_TYPES and vl.video_token_id is not None \
            and ids.shape[1] >= start + frames + 1:
        ids[ids == vl.video_token_id] = 0
        ids[:, start: start + frames] = vl.video_token_id
        out.update(pixel_values_videos=torch.randn(ids.shape[0] * 2 * grid[1] * grid[2], width,
                                                   generator=generator),
                   video_grid_thw=torch.tensor([video] * ids.shape[0]),
                   second_per_grid_ts=torch.full((ids.shape[0],), 1.25))
    return out


def transformers_model(path: str):
    """transformers' own vision-language model of a folder (float32, eager attention)."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", trust_remote_code=False).eval()


@torch.no_grad()
def compare_logits(model, hf_path: str, vl: VisionLanguage, tokens: torch.Tensor, vocab: int,
                   generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """(our logits, transformers') on ``tokens`` with an image (and a Qwen2.5-VL video)
    in each row."""
    inputs = precision_inputs(vl, tokens, generator)
    ours = model.float()(position_ids=None, attention_mask=None, **inputs)[..., :vocab]
    kinds = (inputs["input_ids"] == vl.image_token_id).int()
    if "pixel_values_videos" in inputs:
        kinds += 2 * (inputs["input_ids"] == vl.video_token_id).int()
    theirs = transformers_model(hf_path)(**inputs, mm_token_type_ids=kinds).logits
    return ours.float().cpu(), theirs.float()


def tower_shapes(vl: VisionLanguage) -> Tuple[Tuple[str, Tuple[int, ...]], ...]:
    """(name, shape) of every vision-tower tensor, as the model and the Hugging Face files
    both name it (``visual.*``), from a tower built on the meta device."""
    import warnings

    from accelerate import init_empty_weights

    with warnings.catch_warnings(), init_empty_weights():
        warnings.simplefilter("ignore")
        tower = build_vision_tower(vl)
    return tuple(sorted((VISION_PREFIX + name, tuple(t.shape))
                        for name, t in tower.state_dict().items()))


def part_of(name: str) -> str:
    """'vit', 'aligner' or 'llm': the part of the model parameter ``name`` belongs to (the
    aligner: the merger and Qwen3-VL's deepstack mergers, as ms-swift counts them)."""
    if name.startswith((VISION_PREFIX + "merger.", VISION_PREFIX + "deepstack_merger_list.")):
        return "aligner"
    return "vit" if name.startswith(VISION_PREFIX) else "llm"


def adapted_parts(tuner) -> Tuple[str, ...]:
    """The tower's parts that get LoRA adapters with --tuner_type lora: those whose freeze
    flag is false (ms-swift's rule: the freeze flags choose where the adapters go)."""
    return tuple(part for part, frozen in (("vit", tuner.freeze_vit),
                                           ("aligner", tuner.freeze_aligner)) if not frozen)


def lora_targets(chunk, tuner) -> List[str]:
    """The names of the tower's linear layers (torch's nn.Linear: its attention, MLP and
    merger projections; not the patch embedding's convolution) that get adapters."""
    parts = adapted_parts(tuner)
    if not parts:
        return []
    return [name for name, module in chunk.named_modules()
            if name.startswith(VISION_PREFIX) and type(module) is torch.nn.Linear
            and part_of(name + ".weight") in parts]


def lora_parameters(vl: VisionLanguage, tuner) -> int:
    """The adapters' parameters lora_targets gives (rank x (in + out) per linear layer)."""
    import warnings

    from accelerate import init_empty_weights

    parts = adapted_parts(tuner)
    if not parts:
        return 0
    with warnings.catch_warnings(), init_empty_weights():
        warnings.simplefilter("ignore")
        tower = build_vision_tower(vl)
    return sum(tuner.lora_rank * (module.in_features + module.out_features)
               for name, module in tower.named_modules()
               if type(module) is torch.nn.Linear
               and part_of(VISION_PREFIX + name + ".weight") in parts)


def freeze(chunks, tuner) -> Dict[str, int]:
    """--freeze_vit / --freeze_aligner / --freeze_llm of full finetuning: those parts'
    parameters stop requiring gradients (before DDP and the optimizer see them). Returns
    the parameters frozen per part."""
    frozen = {"vit": tuner.freeze_vit, "aligner": tuner.freeze_aligner, "llm": tuner.freeze_llm}
    counts = {part: 0 for part in frozen}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            part = part_of(name)
            if frozen[part]:
                param.requires_grad_(False)
                counts[part] += param.numel()
    return counts
