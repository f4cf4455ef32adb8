"""Which parameters train: the whole model, or LoRA adapters (--tuner_type) and their flags."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional

from ..errors import ArgumentError
from .fields import FRACTION, POSITIVE, flag

# multi-latent attention's projections in place of linear_qkv (DeepSeek-V3): the direct
# query projection (no q LoRA rank) or the query down and up projections, then the
# key/value ones
MLA_LINEARS = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj",
               "linear_kv_down_proj", "linear_kv_up_proj")
# megatron's linear layers of a GPT block (the local spec), in model order.
MCORE_LINEARS = ("linear_qkv", *MLA_LINEARS, "linear_proj", "linear_fc1", "linear_fc2")
# megatron's gated delta net (Qwen3-Next's and Qwen3.5's linear_attn): its input projection
# (transformers' in_proj_qkvz + in_proj_ba, or in_proj_qkv/z/b/a) and output projection
DELTA_NET_LINEARS = ("in_proj", "out_proj")
# a multi-token prediction layer's [embedding; hidden] -> hidden projection (mtp.layers.K,
# outside its transformer layer): adapted only when named, not by all-linear, as its norms
# stay frozen (docs/lora.md)
MTP_LINEARS = ("eh_proj",)
# The Hugging Face (Llama-style) names of the same layers. megatron fuses q/k/v into one
# layer and gate/up into another: an adapter on a fused layer covers all of its parts.
# DeepSeek-V3's MLA projections are one layer each.
HF_LINEARS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv",
              "q_a_proj": "linear_q_down_proj", "q_b_proj": "linear_q_up_proj",
              "kv_a_proj_with_mqa": "linear_kv_down_proj", "kv_b_proj": "linear_kv_up_proj",
              "o_proj": "linear_proj", "gate_proj": "linear_fc1", "up_proj": "linear_fc1",
              "down_proj": "linear_fc2"}
ALL_LINEAR = "all-linear"
# --modules_to_save: whole modules trained and saved next to the adapters.
SAVABLE_MODULES = {"word_embeddings": "embedding.word_embeddings",
                   "embed_tokens": "embedding.word_embeddings",
                   "output_layer": "output_layer", "lm_head": "output_layer"}
LORA_FLAGS = ("lora_rank", "lora_alpha", "lora_dropout", "target_modules", "target_regex",
              "modules_to_save", "use_rslora", "adapters", "lora_max_fraction")


@dataclass
class TunerArguments:
    tuner_type: str = flag(
        "full", "What trains: 'full' (every parameter) or 'lora' (low-rank adapters on the "
        "linear layers, the base weights frozen; docs/lora.md).", choices=("full", "lora"))
    lora_rank: int = flag(8, "LoRA rank r of each adapter (A: r x in, B: out x r).")
    lora_alpha: float = flag(
        32, "LoRA scaling numerator: the adapter adds B·A·(alpha/r), or alpha/sqrt(r) with "
        "--use_rslora.", range=POSITIVE)
    lora_dropout: float = flag(0.05, "Dropout on the adapter's input.", range=FRACTION)
    target_modules: List[str] = flag(
        [ALL_LINEAR], "Layers that get an adapter: 'all-linear' (every linear layer of the "
        "transformer blocks, MoE experts included; not the router or the output layer), "
        "or names: megatron's "
        + ", ".join(MCORE_LINEARS) + " or Hugging Face's " + ", ".join(HF_LINEARS)
        + " (q/k/v and gate/up are fused in megatron: give all of a fused layer's parts); "
        "in gated delta-net layers " + ", ".join(DELTA_NET_LINEARS) + "; a multi-token "
        "prediction layer's transformer layer is adapted as the decoder's, its "
        + ", ".join(MTP_LINEARS) + " only when named.",
        comma_separated=True)
    target_regex: Optional[str] = flag(
        None, "Instead of --target_modules: a regular expression matched against the whole "
        "megatron module name (e.g. 'decoder\\.layers\\.[01]\\..*linear_qkv').")
    modules_to_save: List[str] = flag(
        [], "Whole modules trained and saved with the adapters: word_embeddings (alias "
        "embed_tokens), output_layer (alias lm_head; not with tied embeddings).",
        comma_separated=True)
    use_rslora: bool = flag(False, "Rank-stabilized LoRA: scale by alpha/sqrt(r).")
    lora_max_fraction: float = flag(
        0.5, "The most parameters the adapters may hold, as a fraction of the parameters of "
        "the layers they adapt (r*(in+out) against in*out, summed); a --lora_rank above it "
        "is refused, naming both counts (a rank that large is no longer low-rank: train "
        "with --tuner_type full). Raise it to train such adapters anyway.", range=POSITIVE)
    adapters: Optional[str] = flag(
        None, "Continue training a LoRA adapter made with peft on --model: a folder of "
        "adapter_config.json and adapter_model.safetensors (peft's save_pretrained). Its "
        "q/k/v and gate/up adapters are fused exactly into megatron's layers; rank, alpha, "
        "rslora and the targets come from adapter_config.json (docs/lora.md).")

    # ms-swift's names and defaults: a vision-language model's full finetuning trains the
    # language model; the vision tower and its merger (the aligner) only when asked. With
    # --tuner_type lora the same flags choose the parts whose linear layers get adapters.
    freeze_vit: bool = flag(
        True, "Vision-language models: keep the vision tower's blocks and patch embedding as "
        "they are (full finetuning), or put no adapters on its linear layers (--tuner_type "
        "lora) (docs/multimodal.md).")
    freeze_aligner: bool = flag(
        True, "Vision-language models: keep the merger that projects the vision features "
        "into the language model as it is (full), or put no adapters on it (lora).")
    freeze_llm: bool = flag(
        False, "Vision-language models: keep the language model (embedding, layers, output "
        "layer) as it is (full), or put no adapters on it (lora).")

    def check(self, explicit) -> None:
        """The tuner flags alone; which layers a regex matches is resolve's to check."""
        if self.tuner_type != "lora":
            given = [name for name in LORA_FLAGS if name in explicit]
            if given:
                raise ArgumentError(f"--{given[0]} configures LoRA adapters: add --tuner_type "
                                    f"lora (now --tuner_type {self.tuner_type})")
            return
        if isinstance(self.lora_rank, bool) or self.lora_rank < 1:
            raise ArgumentError(f"--lora_rank must be a positive integer (the adapter's rank "
                                f"r), got {self.lora_rank}")
        mcore_targets(self.target_modules)
        if self.target_regex is not None:
            if "target_modules" in explicit:
                raise ArgumentError("--target_regex and --target_modules are alternatives; "
                                    "give one of them")
            try:
                re.compile(self.target_regex)
            except re.error as err:
                raise ArgumentError(f"--target_regex {self.target_regex!r} is not a valid "
                                    f"regular expression ({err})") from None
        for name in self.modules_to_save:
            if name not in SAVABLE_MODULES:
                raise ArgumentError(f"--modules_to_save {name!r}: not a module that can be "
                                    f"saved; accepted: {', '.join(SAVABLE_MODULES)}")


def mcore_targets(names) -> List[str]:
    """--target_modules as megatron layer names (in model order); ArgumentError naming an
    unknown name, or one part of a fused layer given without the others."""
    names = list(names)
    if not names:
        raise ArgumentError(f"--target_modules is empty; give {ALL_LINEAR} or layer names")
    if ALL_LINEAR in names:
        if len(names) > 1:
            raise ArgumentError(f"--target_modules {ALL_LINEAR} already names every linear "
                                f"layer; give it alone")
        return list(MCORE_LINEARS + DELTA_NET_LINEARS)
    chosen = set()
    for name in names:
        if name in MCORE_LINEARS + DELTA_NET_LINEARS + MTP_LINEARS:
            chosen.add(name)
        elif name in HF_LINEARS:
            fused = HF_LINEARS[name]
            parts = sorted(k for k, v in HF_LINEARS.items() if v == fused)
            missing = [p for p in parts if p not in names]
            if missing:
                raise ArgumentError(
                    f"--target_modules {name}: megatron fuses {', '.join(parts)} into one "
                    f"layer ({fused}); give all of them (missing {', '.join(missing)}) or "
                    f"{fused}")
            chosen.add(fused)
        else:
            raise ArgumentError(
                f"--target_modules: unknown module {name!r}; accepted: {ALL_LINEAR}, "
                f"{', '.join(MCORE_LINEARS + DELTA_NET_LINEARS + MTP_LINEARS)}, "
                f"{', '.join(HF_LINEARS)}")
    return [name for name in MCORE_LINEARS + DELTA_NET_LINEARS + MTP_LINEARS
            if name in chosen]
