"""Batch, schedule, optimizer and precision flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from .fields import FRACTION, NON_NEGATIVE, POSITIVE, flag

# megatron-core 0.16.1's --recompute_modules (TransformerConfig.recompute_modules), and
# those that apply to swift-mcore's dense GPT layers (the others need MoE or MLA layers).
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                     "shared_experts")
DENSE_RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp")


@dataclass
class TrainingArguments:
    micro_batch_size: int = flag(4, "Samples per forward pass per data-parallel rank.")
    global_batch_size: int = flag(
        16, "Samples per optimizer step over all ranks (micro-batches accumulate).")
    train_iters: int = flag(300, "Optimizer steps to train for.")
    num_train_epochs: Optional[float] = flag(
        None, "Train for this many passes over the training set instead of --train_iters "
        "(whole global batches, rounded up; with --packing a pass is over the packed rows).",
        range=POSITIVE)
    lr: float = flag(1e-3, "Peak learning rate (0 trains nothing: the weights stay as they "
                     "are).", range=NON_NEGATIVE)
    min_lr: float = flag(1e-4, "Learning rate at the end of decay; at most --lr.",
                         range=NON_NEGATIVE)
    # ms-swift's names: a vision-language model's tower and merger on their own peak lr
    vit_lr: Optional[float] = flag(
        None, "Vision-language models: the peak learning rate of the vision tower's blocks "
        "and patch embedding (with --freeze_vit false); its minimum is --min_lr scaled alike. "
        "Default: --lr (docs/multimodal.md).", range=NON_NEGATIVE)
    aligner_lr: Optional[float] = flag(
        None, "Vision-language models: the peak learning rate of the merger(s) that project "
        "the vision features into the language model (with --freeze_aligner false); its "
        "minimum is --min_lr scaled alike. Default: --lr.", range=NON_NEGATIVE)
    lr_warmup_iters: int = flag(30, "Iterations of linear warmup from 0 to lr.")
    lr_decay_iters: Optional[int] = flag(None, "Iterations of decay; default train_iters.")
    lr_decay_style: str = flag(
        "cosine", "Decay shape.", choices=("constant", "linear", "cosine",
                                           "inverse-square-root"))
    weight_decay: float = flag(0.1, "AdamW weight decay.", range=NON_NEGATIVE)
    clip_grad: float = flag(1.0, "Clip the global gradient norm to this; 0 disables.",
                            range=NON_NEGATIVE)
    adam_beta1: float = flag(0.9, "Adam beta1.", range=FRACTION)
    adam_beta2: float = flag(0.95, "Adam beta2.", range=FRACTION)
    adam_eps: float = flag(1e-8, "Adam epsilon (added to the update's denominator).",
                           range=POSITIVE)
    seed: int = flag(42, "Seed for initialization, dropout and the data order.")
    nonfinite_policy: str = flag(
        "stop", "A step whose loss or gradient norm is nan or inf (checked on every rank before "
        "the optimizer step): 'stop' ends the run with an error naming the iteration (exit "
        "code 2; no checkpoint holding nan is written); 'skip' drops the step's gradients "
        "(weights, optimizer state and learning rate unchanged), counts it as skipped and "
        "continues (docs/resume.md, 'NaN and Inf').", choices=("stop", "skip"))
    nonfinite_skip_limit: int = flag(
        10, "With --nonfinite_policy skip: the most non-finite steps skipped in a row; one more "
        "stops the run as 'stop' does.")
    precision: str = flag(
        "auto", "Training precision: auto = bf16 on CUDA (what Megatron-LM's and "
        "Megatron-Bridge's GPU recipes train in), fp32 on CPU; bf16 and fp16 need CUDA. The "
        "start-up line and the checkpoint's args.json say what ran.",
        choices=("auto", "bf16", "fp16", "fp32"))
    bf16: bool = flag(False, "Train in bfloat16 (GPU only): the same as --precision bf16.")
    fp16: bool = flag(False, "Train in float16 with loss scaling (GPU only): the same as "
                      "--precision fp16.")
    fp8_format: Optional[str] = flag(
        None, "FP8 GEMMs through Transformer Engine (GPU only; Hopper or newer): e4m3 for "
        "every FP8 tensor, or hybrid (e4m3 forward, e5m2 for the gradients). Needs "
        "Transformer Engine's layer spec; the weights and the optimizer stay in --precision.",
        choices=("e4m3", "hybrid"))
    fp8_recipe: str = flag(
        "delayed", "How FP8 tensors are scaled (needs --fp8_format): delayed (from an amax "
        "history), tensorwise (current per-tensor scaling), blockwise, or mxfp8 (Blackwell).",
        choices=("delayed", "tensorwise", "blockwise", "mxfp8"))
    fp8_param_gather: bool = flag(
        False, "Keep the GEMM weights in FP8 and all-gather them in FP8 (needs --fp8_format "
        "and --use_distributed_optimizer): megatron's fp8_param.")
    trim_host_memory: bool = flag(
        False, "On CPU (glibc): hand the heap's free pages back to the system before each "
        "micro-batch's forward. Lowers the peak RSS but costs speed: the next forward "
        "faults the pages in again (measured: benchmarks/README.md#host-memory-on-cpu). "
        "Ignored on CUDA (docs/gpu.md, 'Host memory on CPU').")
    cpu_matmul: str = flag(
        "auto", "On CPU, the GEMM of the linear layers' forward and input-gradient products: "
        "onednn = torch's oneDNN linear (faster training steps than mkl on the CPU measured: "
        "benchmarks/README.md#the-cpu-gemm-onednn-against-mkl), mkl = torch.matmul (MKL's "
        "sgemm, megatron's own path), auto = onednn where the torch build has it. The two "
        "agree within fp32 rounding, not bit for bit: resume under the same choice for a "
        "bit-exact continuation. Ignored on CUDA; the start-up line says what runs.",
        choices=("auto", "onednn", "mkl"))
    recompute_granularity: Optional[str] = flag(
        None, "Activation recompute (megatron-core's): full = keep only the input of each "
        "recomputed layer chunk and run its forward again in the backward pass; selective = "
        "recompute only --recompute_modules inside every layer; none by default "
        "(docs/gpu.md, 'Activation recompute').", choices=("selective", "full"))
    recompute_method: Optional[str] = flag(
        None, "With --recompute_granularity full: uniform = split each pipeline stage's "
        "layers (each model chunk's, with virtual stages) into chunks of "
        "--recompute_num_layers and recompute every chunk; block = recompute the first "
        "--recompute_num_layers layers of each stage (model chunk), keep the rest; default "
        "uniform.", choices=("uniform", "block"))
    recompute_num_layers: Optional[int] = flag(
        None, "With --recompute_granularity full: layers per recomputed chunk (uniform; must "
        "divide the layers of every pipeline stage, or model chunk with virtual stages, "
        "uneven splits included) or layers recomputed per stage or model chunk (block; at "
        "most its layers); default 1.")
    recompute_modules: List[str] = flag(
        ["core_attn"], "With --recompute_granularity selective: the parts of each layer to "
        "recompute, comma- or space-separated: core_attn (the attention scores and softmax), "
        "layernorm (the two norms; a no-op with Transformer Engine's fused norms), mlp (the "
        "whole MLP). megatron's moe_act, moe, shared_experts and mla_up_proj (parts of MoE and "
        "multi-latent attention layers) are not recomputed by swift-mcore yet: refused.",
        choices=RECOMPUTE_MODULES, comma_separated=True)
