"""Model FLOPs per iteration and throughput figures (tokens/s, TFLOP/s)."""

from __future__ import annotations

import math
import time
from typing import Dict, List


def flops_per_token(config) -> float:
    """Training FLOPs per token: 6 x matmul parameters + the attention score/value matmuls.

    Forward is 2 FLOPs per multiply-add, backward twice the forward, hence the 6; attention
    adds 2 matmuls of seq x head_dim per head and layer (Q K^T and scores x V), not halved
    for the causal mask: 12 x layers x seq x heads x head_dim per token, the count of
    PaLM's appendix B and Megatron-LM's classic formula.
    """
    m = config.model
    h, layers, seq = m.hidden_size, m.num_layers, m.seq_length
    heads = m.num_attention_heads
    head_dim = m.kv_channels or h // heads
    groups = m.num_query_groups or heads
    attn_proj = h * head_dim * (heads + 2 * groups) + heads * head_dim * h
    per_ffn = h * (3 if m.swiglu else 2)
    mlp = [per_ffn * m.ffn_hidden_size] * layers
    if m.num_experts is not None:  # a MoE layer's active matmuls: router, top-k, shared
        from ..arguments.model import moe_layer_pattern

        active = h * m.num_experts + per_ffn * (
            m.moe_router_topk * m.moe_ffn_hidden_size
            + (m.moe_shared_expert_intermediate_size or 0))
        mlp = [active if moe else dense
               for moe, dense in zip(moe_layer_pattern(m), mlp)]
    logits = h * config.padded_vocab_size
    matmul_params = layers * attn_proj + sum(mlp) + logits
    # Forward multiply-adds per token: seq x head_dim per head for each of the 2 matmuls.
    attention_macs = layers * 2 * seq * heads * head_dim
    return 6.0 * matmul_params + 6.0 * attention_macs


# The router's auxiliary losses (training/moe_metrics.py), averaged like the loss.
MOE_LOSSES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss",
              "z_loss")


class LogWindow:
    """Averages loss and grad norm over the iterations between two log lines, and times
    them for tokens/s and TFLOP/s (per rank, as Megatron reports)."""

    def __init__(self, flops_per_token: float, world_size: int):
        self.flops_per_token = flops_per_token
        self.world_size = world_size
        self._reset()

    def _reset(self) -> None:
        self.start = time.perf_counter()
        self.steps: List[Dict[str, float]] = []

    def add(self, step: Dict[str, float]) -> None:
        self.steps.append(step)

    def flush(self) -> Dict[str, float]:
        seconds = max(time.perf_counter() - self.start, 1e-9)
        metrics = {"lr": self.steps[-1]["lr"], "skipped": sum(s["skipped"] for s in self.steps)}
        averaged = ["loss", "grad_norm"] + [k for k in self.steps[-1] if k in MOE_LOSSES]
        for key in averaged:  # a skipped non-finite step is left out
            values = [s[key] for s in self.steps
                      if s.get(key) is not None and math.isfinite(s[key])]
            metrics[key] = sum(values) / len(values) if values else None
        # Real input tokens (padding left out), as counted on the last pipeline stage.
        tokens = sum(s.get("tokens") or 0.0 for s in self.steps)
        metrics["tokens"] = tokens
        metrics["tokens_per_s"] = tokens / seconds
        metrics["tflops"] = tokens * self.flops_per_token / seconds / self.world_size / 1e12
        self._reset()
        return metrics
