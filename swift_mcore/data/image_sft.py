"""sft datasets of image and video conversations: the stored rows (image_cache) split,
packed and batched, each row's image and video patches made again when it is loaded."""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np


def row_widths(config):
    """(pad every row to --seq_length, pad each row's width to a multiple of): pipeline
    stages exchange one fixed shape; --sequence_parallel splits each row over the TP ranks
    and --context_parallel_size into 2 x CP chunks."""
    p = config.parallel
    cp = p.context_parallel_size
    return p.pipeline_model_parallel_size > 1, (
        (p.tensor_model_parallel_size if p.sequence_parallel else 1) * (2 * cp if cp > 1 else 1))


def _sft_dataset_class():
    from .sft_datasets import SftDataset

    class ImageSftDataset(SftDataset):
        """SftDataset rows with their images: the patches are made again per item from the
        image files (by the image processor, deterministically; image_cache checks each
        file is the one the tokens were made for), so memory holds no pixels between
        steps."""

        def __init__(self, encoded, rows, images, *args, **kwargs):
            super().__init__(encoded, rows, *args, **kwargs)
            self.images = images        # image_cache.CachedImages of the stored samples

        def __getitem__(self, row: int) -> Dict[str, Any]:
            item = super().__getitem__(row)
            samples = [self.images.index(int(self.encoded.starts[k]))
                       for k in self.conversations(row)]
            # a packed row's images, then its videos: the model fills the pads by kind
            item["pixels"] = self.images.patches(samples)
            item["videos"] = self.images.videos(samples)
            return item

        def collate(self, rows: List[Dict[str, Any]]) -> Dict[str, Any]:
            import torch

            from .multimodal import VIDEO_INPUTS

            batch = super().collate(rows)
            pixels = [r["pixels"] for r in rows if r["pixels"] is not None]
            if pixels:
                batch["pixel_values"] = torch.cat([p[0] for p in pixels])
                batch["image_grid_thw"] = torch.cat([p[1] for p in pixels])
            videos = [r["videos"] for r in rows if r["videos"] is not None]
            if videos:
                for i, key in enumerate(VIDEO_INPUTS):
                    batch[key] = torch.cat([v[i] for v in videos])
            return batch

    return ImageSftDataset


def build_image_sft_datasets(config, tokenizer, log=print, on_cache=lambda event: None):
    """(train, valid, None) datasets of image and video conversations for a
    vision-language --model: the rows tokenized once into the token cache (image_cache;
    every row read and every image and video checked first when it is built; ``on_cache``
    hears "built" or "reused"), or read from a --cached_dataset folder. A sample longer
    than --seq_length with its images' and videos' tokens is an error naming its row
    (images and videos cannot be cut)."""
    from ..arguments.sft import column_map
    from .image_cache import (cached_image_tokens, check_lengths, image_encoder,
                              load_image_sft_dataset)
    from .sft_datasets import sft_fingerprint, split
    from .token_cache import pack_plan

    s, seq = config.sft, config.model.seq_length
    encoder = image_encoder(config, tokenizer)
    template = encoder.template
    columns = column_map(s.columns)
    if s.cached_dataset:
        train = load_image_sft_dataset(s.cached_dataset, encoder, columns)[0]
    else:
        train = cached_image_tokens(config.dataset_sources, columns, "--dataset", encoder,
                                    s.dataset_num_proc, on_event=on_cache)
    valid = (cached_image_tokens(config.val_dataset_sources, columns, "--val_dataset",
                                 encoder, s.dataset_num_proc, on_event=on_cache)
             if config.val_dataset_sources else None)
    for images in (train, valid):
        if images is not None:
            check_lengths(images, seq)
    train_encoded = train.tokenized.encoded
    valid_encoded, val_images = (valid.tokenized.encoded, valid) if valid else (None, None)
    if s.split_dataset_ratio:
        train_encoded, valid_encoded = split(train_encoded, s.split_dataset_ratio,
                                             config.training.seed)
        val_images = train
    log(f"sft data: {len(train_encoded)} image/video conversations (template: "
        f"{template.describe()})")
    fingerprint = sft_fingerprint(config, tokenizer, template)
    pad_id = tokenizer.pad if tokenizer.pad >= 0 else tokenizer.eod

    def dataset(encoded, images, name):
        if encoded is None:
            return None
        if s.packing:
            # a --cached_dataset folder's stored plan, when it has one for these samples
            rows = pack_plan(encoded.positions(), seq,
                             s.cached_dataset if name == "train" else None,
                             on_event=lambda event: on_cache(f"packing {event}"))
        else:
            n = len(encoded)
            rows = (np.arange(n, dtype=np.int64), np.arange(n + 1, dtype=np.int64))
        pad_fixed, pad_multiple = row_widths(config)
        return _sft_dataset_class()(encoded, rows, images, seq, pad_id, s.packing,
                                    pad_fixed, f"{fingerprint}:{name}", pad_multiple)

    return (dataset(train_encoded, train, "train"),
            dataset(valid_encoded, val_images, "valid"), None)
