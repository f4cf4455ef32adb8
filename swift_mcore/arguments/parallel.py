"""Model/data parallel layout and gradient bucketing flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .fields import POSITIVE, flag


@dataclass
class ParallelArguments:
    tensor_model_parallel_size: int = flag(1, "Tensor-parallel ranks per model replica.")
    pipeline_model_parallel_size: int = flag(1, "Pipeline stages per model replica.")
    num_virtual_stages_per_pipeline_rank: Optional[int] = flag(
        None, "The interleaved pipeline schedule: each pipeline rank holds this many model "
        "chunks (virtual stages) of --num_layers / (PP x this) layers each, which shrinks "
        "the pipeline bubble by as much; needs --pipeline_model_parallel_size > 1.")
    num_layers_per_virtual_pipeline_stage: Optional[int] = flag(
        None, "The interleaved pipeline schedule given by the layers per model chunk instead "
        "(--num_virtual_stages_per_pipeline_rank = --num_layers / (PP x this), a counted "
        "embedding and loss included as in Megatron-LM); not with "
        "--decoder_first/last_pipeline_num_layers, whose chunks differ in size.")
    decoder_first_pipeline_num_layers: Optional[int] = flag(
        None, "Layers of the first pipeline stage, when it should hold fewer (it also holds "
        "the embedding); the other stages split the rest evenly. With "
        "--num_virtual_stages_per_pipeline_rank V every stage's layers split into V equal "
        "model chunks.")
    decoder_last_pipeline_num_layers: Optional[int] = flag(
        None, "Layers of the last pipeline stage (it also holds the output layer and loss); "
        "the other stages split the rest evenly.")
    account_for_embedding_in_pipeline_split: bool = flag(
        False, "Count the embedding as one layer when splitting the layers over the pipeline "
        "stages (the first stage gets one layer fewer; with virtual stages its first model "
        "chunk does, and may hold only the embedding).")
    account_for_loss_in_pipeline_split: bool = flag(
        False, "Count the output layer and loss as one layer when splitting the layers over "
        "the pipeline stages (the last stage gets one layer fewer; with virtual stages its "
        "last model chunk does, and may hold only the output layer).")
    context_parallel_size: int = flag(
        1, "Context-parallel ranks per model replica: each sequence is cut into 2 x this many "
        "chunks, and each rank holds two of them (megatron's causal load balance); the "
        "attention sees the whole sequence. --seq_length must be a multiple of 2 x this. On "
        "GPU Transformer Engine's attention (--cp_comm_type); on CPU keys and values are "
        "all-gathered over the group (docs/cpu.md).")
    cp_comm_type: str = flag(
        "p2p", "How Transformer Engine's attention exchanges keys and values over the "
        "context-parallel group on GPU: p2p (a ring), a2a (all-to-all, as Ulysses), "
        "allgather, or a2a+p2p. On CPU only allgather runs.",
        choices=("p2p", "a2a", "allgather", "a2a+p2p"))
    sequence_parallel: bool = flag(False, "Shard layer norms and dropout along the sequence "
                                   "across tensor-parallel ranks (needed by MoE with TP); "
                                   "pt's --seq_length (sft's too under pipeline "
                                   "parallelism) must be a multiple of the TP size. "
                                   "On a GPU with Transformer Engine's layer spec or apex "
                                   "(docs/gpu.md); on CPU with --hidden_dropout 0.")
    num_buckets: Optional[int] = flag(
        None, "Split gradients into this many all-reduce buckets (sets bucket_size to "
        "ceil(trainable parameters / num_buckets)); needs --overlap_grad_reduce.")
    bucket_size: Optional[int] = flag(
        None, "Parameters per gradient bucket (wins over --num_buckets); needs "
        "--overlap_grad_reduce.")
    overlap_grad_reduce: bool = flag(
        False, "Start each bucket's all-reduce as soon as its gradients are ready.")
    overlap_param_gather: bool = flag(
        False, "With --use_distributed_optimizer: all-gather the updated weights bucket by "
        "bucket during the next forward pass instead of at the end of the optimizer step "
        "(needs --overlap_grad_reduce).")
    align_param_gather: bool = flag(
        False, "With --overlap_param_gather and the interleaved pipeline: every pipeline "
        "stage starts each model chunk's weight all-gather at the same point of the "
        "schedule (megatron's param_sync_func) instead of at its first layer.")
    use_distributed_optimizer: bool = flag(
        False, "Shard the optimizer state (Adam's moments, the fp32 weights) across the "
        "data-parallel ranks (megatron's distributed optimizer, ZeRO-1); checkpoints keep it "
        "whole per parameter, so they resume at any data-parallel size (docs/gpu.md).")
    distributed_backend: Optional[str] = flag(
        None, "Process-group backend; default nccl with CUDA, gloo without (nccl without CUDA "
        "and gloo with CUDA are refused).",
        choices=("nccl", "gloo"))
    expert_model_parallel_size: int = flag(
        1, "Expert-parallel ranks: the routed experts of each MoE layer are split over them "
        "(inside the data-parallel ranks; needs --num_experts divisible by it).")
    expert_tensor_parallel_size: Optional[int] = flag(
        None, "Tensor-parallel ranks of each routed expert (default: "
        "--tensor_model_parallel_size). 1 keeps every expert whole on its rank while the "
        "attention and dense layers are split over TP (gpt-oss's biased experts need it); "
        "1 or the TP size.")
    distributed_timeout_minutes: float = flag(
        30.0, "How long a collective waits for the other ranks, and how long one iteration "
        "(step, evaluation, save) may take, before the run ends with the stacks of its ranks "
        "(fractions allowed, e.g. 0.5; docs/launch.md).", range=POSITIVE)
