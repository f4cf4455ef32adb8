"""The multi-token prediction layers of a Hugging Face folder (DeepSeek-V3, GLM-4.5: the
layers past ``num_hidden_layers``, which transformers itself ignores) and megatron's MTP block.

Hugging Face (model.layers.<num_layers + k>.)   megatron (mtp.layers.<k>.)
  enorm, hnorm                                   enorm, hnorm
  eh_proj                                        eh_proj      ([embedding; hidden] both)
  shared_head.norm                               final_layernorm
  input_layernorm, self_attn.*, mlp.* ...        transformer_layer.* (a decoder layer's names)
  embed_tokens, shared_head.head                 none: the model's embedding and output layer

megatron's MTP layers share the model's embedding and output layer; the folder holds a copy
of each per MTP layer. A folder whose copies differ from the model's is refused when it is
loaded (megatron cannot hold them apart); on export the copies are the model's again.

Qwen3-Next and Qwen3.5 (``PREFIXED``) name their MTP layer apart from the decoder's
(``mtp_num_hidden_layers`` in config.json, which transformers also ignores), without copies:

Hugging Face                                    megatron (mtp.layers.0.)
  mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden   enorm, hnorm
  mtp.fc                                              eh_proj   ([embedding; hidden] both)
  mtp.norm                                            final_layernorm
  mtp.layers.0.* (a full-attention decoder layer)     transformer_layer.*

Their fc and norms are one for all MTP layers (transformers' configs allow more layers
sharing them), megatron's are per layer: only one MTP layer is expressible.
"""

from __future__ import annotations

import re
from typing import Callable, List, Optional, Tuple

import torch

# megatron suffix (after mtp.layers.<k>.) -> HF suffix, copied as they are
NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
         "eh_proj.weight": "eh_proj.weight", "final_layernorm.weight": "shared_head.norm.weight"}
# HF suffix of the copies -> the model's tensor they copy (lm_head: the embedding when tied)
COPIES = {"embed_tokens.weight": "model.embed_tokens.weight",
          "shared_head.head.weight": "lm_head.weight"}
MCORE_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
TRANSFORMER_LAYER = "transformer_layer."
# families whose folders hold their MTP layer under mtp.* (the others: past the decoder's)
PREFIXED = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
# megatron suffix (after mtp.layers.0.) -> the prefixed folders' name
PREFIXED_NAMES = {"enorm.weight": "mtp.pre_fc_norm_embedding.weight",
                  "hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
                  "eh_proj.weight": "mtp.fc.weight", "final_layernorm.weight": "mtp.norm.weight"}
PREFIXED_LAYER = "mtp.layers."


def prefixed(family_name: str) -> bool:
    """Whether a family's folders name their MTP layer mtp.* (Qwen3-Next, Qwen3.5)."""
    return family_name in PREFIXED


def count_key(family_name: str) -> str:
    """The config.json key of a family's MTP layer count."""
    return "mtp_num_hidden_layers" if prefixed(family_name) else "num_nextn_predict_layers"


def prefixed_hf_tensors(hidden: int) -> Tuple[List[Tuple[str, Tuple]], List[Tuple[str, Tuple]]]:
    """(tensors before, after) the decoder layer's own in a prefixed folder's MTP layer."""
    return ([(PREFIXED_NAMES["eh_proj.weight"], (hidden, 2 * hidden)),
             (PREFIXED_NAMES["enorm.weight"], (hidden,)),
             (PREFIXED_NAMES["hnorm.weight"], (hidden,))],
            [(PREFIXED_NAMES["final_layernorm.weight"], (hidden,))])


def hf_extra_tensors(prefix: str, hidden: int, vocab: int
                     ) -> Tuple[List[Tuple[str, Tuple[int, ...]]], List[Tuple[str, Tuple]]]:
    """(tensors before, after) a decoder layer's own in one MTP layer of the folder."""
    return ([(prefix + "embed_tokens.weight", (vocab, hidden)),
             (prefix + "enorm.weight", (hidden,)), (prefix + "hnorm.weight", (hidden,)),
             (prefix + "eh_proj.weight", (hidden, 2 * hidden))],
            [(prefix + "shared_head.norm.weight", (hidden,)),
             (prefix + "shared_head.head.weight", (vocab, hidden))])


def copied(hf_suffix: str, tied: bool) -> Optional[str]:
    """The model tensor an MTP layer's HF tensor copies (None: its own)."""
    source = COPIES.get(hf_suffix)
    if source == "lm_head.weight" and tied:
        return "model.embed_tokens.weight"
    return source


def hf_name(suffix: str) -> Optional[str]:
    """The HF suffix of megatron MTP suffix ``suffix`` (after mtp.layers.<k>.), None for the
    transformer layer's."""
    return NAMES.get(suffix)


def mcore_name(hf_suffix: str) -> Optional[str]:
    return {hf: mc for mc, hf in NAMES.items()}.get(hf_suffix)


def folder_layers(family, folder) -> int:
    """How many MTP layers an HFFolder holds: those of config.json's num_nextn_predict_layers
    whose tensors its weights have (a folder transformers wrote keeps the key, 1 for
    DeepSeek-V3, without the layers); 0 for a family without MTP layers."""
    config = folder.config
    value = config.get(count_key(family.name)) or 0
    if not getattr(family, "mtp", False) or isinstance(value, bool) \
            or not isinstance(value, int):
        return 0
    if prefixed(family.name):  # a folder transformers wrote keeps the key, not the layer
        return value if PREFIXED_NAMES["eh_proj.weight"] in folder.weight_map else 0
    first = int(config.get("num_hidden_layers") or 0)
    return sum(1 for k in range(value)
               if f"model.layers.{first + k}.eh_proj.weight" in folder.weight_map)


def check_copies(layout, read: Callable[..., torch.Tensor], where: str,
                 rows_per_read: int = 4096) -> None:
    """ArgumentError unless every MTP layer's embed_tokens and shared_head.head equal the
    model's (read in row blocks: never a whole vocabulary matrix twice)."""
    from ..errors import ArgumentError

    if layout.mtp_prefixed:  # Qwen3-Next's MTP layer holds no copies
        return
    for k in range(layout.mtp_layers):
        prefix = f"model.layers.{layout.num_layers + k}."
        for suffix in COPIES:
            source = copied(suffix, layout.tied)
            for start in range(0, layout.vocab, rows_per_read):
                rows = slice(start, min(start + rows_per_read, layout.vocab))
                if not torch.equal(read(prefix + suffix, rows=rows), read(source, rows=rows)):
                    raise ArgumentError(
                        f"{where}: {prefix}{suffix} differs from {source}; megatron's MTP "
                        f"layers share the model's embedding and output layer, so a folder "
                        f"whose MTP copies differ cannot be loaded (give --mtp_num_layers 0 "
                        f"to leave its MTP layers out)")


def check_flag(family, model_args) -> None:
    """--mtp_num_layers against the MTP layers a folder holds: unset is refused for a folder
    that holds some (they would be dropped without a word), 0 leaves them out, the folder's
    count loads them; another count is refused. A folder without MTP layers takes any
    count (new layers from their initialization)."""
    from ..errors import ArgumentError

    from .text_part import open_folder

    if not getattr(family, "mtp", False) or not getattr(model_args, "model", None):
        return
    held = folder_layers(family, open_folder(model_args.model, flag="--model"))
    key = count_key(family.name)
    wanted = model_args.mtp_num_layers
    if not held or wanted in (0, held):
        return
    where = f"--model {getattr(model_args, 'model', None) or ''}".rstrip()
    if wanted is None:
        raise ArgumentError(
            f"{where} holds {held} multi-token prediction layer(s) ({key} "
            f"{held}): give --mtp_num_layers {held} to load, train and export them, or "
            f"--mtp_num_layers 0 to leave them out")
    raise ArgumentError(f"--mtp_num_layers {wanted}: {where} holds {held} multi-token "
                        f"prediction layer(s); give --mtp_num_layers {held} (or 0 to leave "
                        f"them out)")
