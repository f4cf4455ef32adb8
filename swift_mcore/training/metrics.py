"""Model FLOPs per token (and recompute's extra) and the log window's figures: tokens/s,
TFLOP/s, MFU, peak memory."""

from __future__ import annotations

import math
import time
from typing import Callable, Dict, List, Optional

from .mtp_metrics import is_mtp_loss


def _layer_flops(config) -> Dict[str, object]:
    """Forward multiply-adds per token of one layer: its attention projections, the attention
    score/value matmuls, each layer's MLP (a MoE layer's active matmuls: router, top-k
    experts, shared expert); and of the output layer."""
    m = config.model
    h, seq = m.hidden_size, m.seq_length
    heads = m.num_attention_heads
    head_dim = m.kv_channels or h // heads
    groups = m.num_query_groups or heads
    per_ffn = h * (3 if m.swiglu else 2)
    mlp_layers = [per_ffn * m.ffn_hidden_size] * m.num_layers
    if m.num_experts is not None:
        from ..arguments.model import moe_layer_pattern

        active = h * m.num_experts + per_ffn * (
            m.moe_router_topk * m.moe_ffn_hidden_size
            + (m.moe_shared_expert_intermediate_size or 0))
        mlp_layers = [active if moe else dense
                      for moe, dense in zip(moe_layer_pattern(m), mlp_layers)]
    return {
        "attn_proj": h * head_dim * (heads + 2 * groups) + heads * head_dim * h,
        "mlp_layers": mlp_layers,
        # seq x head_dim per head for each of the 2 matmuls (Q K^T, scores x V)
        "core_attn": 2 * seq * heads * head_dim,
        "logits": h * config.padded_vocab_size,
    }


def flops_per_token(config) -> float:
    """Model FLOPs per trained token: 6 x matmul parameters + the attention score/value matmuls.

    Forward is 2 FLOPs per multiply-add, backward twice the forward, hence the 6; attention
    adds 2 matmuls of seq x head_dim per head and layer (Q K^T and scores x V), not halved
    for the causal mask: 12 x layers x seq x heads x head_dim per token, the count of
    PaLM's appendix B and Megatron-LM's classic formula. The output layer is counted, the
    input embedding (a lookup) is not; grouped-query attention projects groups, not heads,
    to keys and values; SwiGLU has 3 matrices.
    """
    f = _layer_flops(config)
    layers = config.model.num_layers
    return 6.0 * (layers * (f["attn_proj"] + f["core_attn"]) + sum(f["mlp_layers"])
                  + f["logits"])


def recompute_flops_per_token(config) -> float:
    """The extra forward FLOPs per token that activation recompute runs in the backward pass:
    with full, the whole forward of each recomputed layer (uniform: every layer; block:
    --recompute_num_layers per model chunk); with selective, the forward of the
    recomputed modules (core_attn: the score/value matmuls; mlp: the MLP; the norms have
    no matmuls). The output layer is never recomputed."""
    t, m = config.training, config.model
    f = _layer_flops(config)
    if t.recompute_granularity == "full":
        # megatron's block recomputes the first layers of each model chunk (every virtual
        # stage of every pipeline stage, uneven ones included)
        layers = (m.num_layers if t.recompute_method == "uniform"
                  else sum(min(t.recompute_num_layers, len(chunk))
                           for stage in config.args.pipeline_chunk_layers() for chunk in stage))
        mlp = sum(f["mlp_layers"]) / m.num_layers  # MoE and dense layers alike, on average
        return 2.0 * layers * (f["attn_proj"] + mlp + f["core_attn"])
    if t.recompute_granularity == "selective":
        extra = 0.0
        if "core_attn" in t.recompute_modules:
            extra += m.num_layers * f["core_attn"]
        if "mlp" in t.recompute_modules:
            extra += sum(f["mlp_layers"])
        return 2.0 * extra
    return 0.0


def executed_flops_per_token(config) -> float:
    """What the devices compute per token: the model's FLOPs and recompute's extra forward
    (the TFLOP/s and MFU of the log line)."""
    return flops_per_token(config) + recompute_flops_per_token(config)


# The router's auxiliary losses (training/moe_metrics.py), averaged like the loss.
MOE_LOSSES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss",
              "z_loss")


class LogWindow:
    """Averages loss and grad norm over the iterations between two log lines, and times
    them for tokens/s, TFLOP/s per rank (as Megatron reports), MFU against ``peak_tflops``
    (one rank's device) and the peak memory ``memory_gb()`` returns."""

    def __init__(self, flops_per_token: float, world_size: int,
                 peak_tflops: Optional[float] = None,
                 memory_gb: Optional[Callable[[], float]] = None):
        self.flops_per_token = flops_per_token
        self.world_size = world_size
        self.peak_tflops = peak_tflops
        self.memory_gb = memory_gb
        self._reset()

    def _reset(self) -> None:
        self.start = time.perf_counter()
        self.steps: List[Dict[str, float]] = []

    def add(self, step: Dict[str, float]) -> None:
        self.steps.append(step)

    def flush(self) -> Dict[str, float]:
        seconds = max(time.perf_counter() - self.start, 1e-9)
        metrics = {"lr": self.steps[-1]["lr"], "skipped": sum(s["skipped"] for s in self.steps)}
        averaged = ["loss", "grad_norm"] + [k for k in self.steps[-1]
                                            if k in MOE_LOSSES or is_mtp_loss(k)]
        for key in averaged:  # a skipped non-finite step is left out
            values = [s[key] for s in self.steps
                      if s.get(key) is not None and math.isfinite(s[key])]
            metrics[key] = sum(values) / len(values) if values else None
        # Real input tokens (padding left out), as counted on the last pipeline stage.
        tokens = sum(s.get("tokens") or 0.0 for s in self.steps)
        metrics["tokens"] = tokens
        metrics["tokens_per_s"] = tokens / seconds
        metrics["tflops"] = tokens * self.flops_per_token / seconds / self.world_size / 1e12
        if self.peak_tflops:
            metrics["mfu_percent"] = 100.0 * metrics["tflops"] / self.peak_tflops
        if self.memory_gb is not None:
            metrics["peak_memory_gb"] = self.memory_gb()
        self._reset()
        return metrics
