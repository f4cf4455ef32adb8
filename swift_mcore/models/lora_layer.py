"""The LoRA layer peft is given for megatron's ColumnParallelLinear and RowParallelLinear,
and for Transformer Engine's column/row-parallel linears on the TE spec.

peft 0.21's own megatron dispatcher fails before building a layer (it reads a
``fan_in_fan_out`` keyword peft no longer passes), and its parallel layer returns the tuple
megatron's linears give into the next matmul, so models/lora.py registers this one with
peft instead; peft knows no TE wrapper of megatron's at all. For a column-parallel base,
A (r x in) is replicated and B is column-parallel; for a row-parallel base, A is
row-parallel and B (out x r) replicated; under --sequence_parallel they take the base's
layout (A on the sequence slice, B gathering; A reduce-scattering, B on the slice) and the
replicated factor's gradient is summed over the TP ranks. What differs between a
megatron base and a TE one is read once into a ``BaseLinear`` (``describe``; TE's part is
models/lora_te.py).
Its own module because it subclasses peft's LoraLayer: importing peft (and transformers
with it) costs seconds, which a full-parameter run should not pay.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from . import lora_te, low_rank_add


@dataclass(frozen=True)
class BaseLinear:
    """What the LoRA layer needs of its base linear."""

    row_parallel: bool        # TP shards the input dimension (else the output dimension)
    in_features: int          # of the whole layer, not this rank's shard
    out_features: int
    input_is_parallel: bool   # row-parallel: the input arrives already split over TP
    fused_norm: bool          # the base normalises its input itself (TE's LayerNormLinear)


def describe(module) -> Optional[BaseLinear]:
    """The base linear ``module`` as the LoRA layer sees it; None: not a linear it adapts."""
    from megatron.core import tensor_parallel

    if isinstance(module, tensor_parallel.RowParallelLinear):
        return BaseLinear(True, module.input_size, module.output_size,
                          module.input_is_parallel, False)
    if isinstance(module, tensor_parallel.ColumnParallelLinear):
        return BaseLinear(False, module.input_size, module.output_size, False, False)
    kind = lora_te.kind(module)
    if kind is None:
        return None
    in_features, out_features = lora_te.full_features(module, kind)
    # megatron's TE row-parallel linear takes only an already split input
    return BaseLinear(kind == lora_te.ROW, in_features, out_features, True,
                      kind == lora_te.NORM_COLUMN)


def base_classes() -> Tuple[type, ...]:
    """The linear classes registered with peft for this layer."""
    from megatron.core import tensor_parallel

    return (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear,
            *lora_te.linear_kinds())


class LoraParallelLinear(nn.Module, LoraLayer):
    """peft's LoRA layer for megatron's parallel linears (its own or Transformer Engine's):
    returns megatron's (output, bias) pair, keeps the base weights' checkpoint keys, and
    draws A's initial values from the seed and the layer's global name, so that they do not
    depend on the TP/PP layout."""

    def __init__(self, base_layer, adapter_name: str, config, r: int = 0,
                 lora_alpha: float = 1, **kwargs):
        super().__init__()
        kwargs.pop("megatron_config", None)
        LoraLayer.__init__(self, base_layer=base_layer, **kwargs)
        self.is_parallel_a = self.base_linear.row_parallel
        self.fan_in_fan_out = False
        # set by apply(): the base is a gated linear_fc1 ([gate; up] rows per TP rank)
        self.gated_rows = False
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config)

    def _get_in_out_features(self, module) -> Tuple[int, int]:
        # peft's LoraLayer.__init__ asks this; peft reads megatron's full sizes but not TE's
        self.base_linear = describe(module)
        return self.base_linear.in_features, self.base_linear.out_features

    def update_layer(self, adapter_name: str, r: int, lora_alpha: float, config,
                     inference_mode: bool = False, **kwargs) -> None:
        from megatron.core import tensor_parallel

        if r <= 0:
            raise ValueError(f"LoRA rank must be positive, got {r}")
        base = self.get_base_layer()
        self.r[adapter_name] = r
        self.lora_alpha[adapter_name] = lora_alpha
        self.lora_dropout[adapter_name] = (nn.Dropout(p=config.lora_dropout)
                                           if config.lora_dropout > 0 else nn.Identity())
        # The megatron layers create the full factor on the CPU and keep this rank's slice
        # (and mark it tensor-parallel for the gradient norm); values are set by init_adapter.
        mc = copy.copy(base.config)
        mc.use_cpu_initialization, mc.perform_initialization = True, True
        dtype = base.weight.dtype
        zeros = nn.init.zeros_
        # A routed expert's linear is split over the expert-TP group and leaves its
        # communication to the token dispatcher (megatron's explicit_expert_comm): its
        # parallel factor is built as an expert linear of the same group, so that it is
        # split as the base weight is and communicates as it does.
        expert = bool(getattr(base, "is_expert", False))
        group = dict(is_expert=True, tp_group=base.tp_group) if expert else {}
        if self.is_parallel_a:
            lora_a = tensor_parallel.RowParallelLinear(
                self.in_features, r, config=mc, init_method=zeros, bias=False,
                input_is_parallel=self.base_linear.input_is_parallel, skip_bias_add=True,
                **group)
            lora_b = nn.Linear(r, self.out_features, bias=False, dtype=dtype)
            parallel, replicated = lora_a, lora_b
        else:
            lora_a = nn.Linear(self.in_features, r, bias=False, dtype=dtype)
            lora_b = tensor_parallel.ColumnParallelLinear(
                r, self.out_features, config=mc, init_method=zeros, bias=False,
                gather_output=False, skip_bias_add=True, **group)
            parallel, replicated = lora_b, lora_a
        # The replicated factor's gradient is only this rank's part where its side of the
        # layer is split over the TP ranks: under --sequence_parallel it sees (column) or
        # produces (row) this rank's slice of the sequence, and an expert's factors
        # exchange nothing (the dispatcher gathered the tokens, and sums the outputs,
        # over the expert-TP ranks). megatron sums the gradients of parameters marked
        # ``sequence_parallel`` over the TP ranks (finalize_model_grads), as the norms'.
        if parallel.tp_group.size() > 1 and (mc.sequence_parallel or expert):
            replicated.weight.sequence_parallel = True
        # this rank's slice of the sequence enters A: its dropout mask is drawn as
        # megatron draws the masks of sequence-split activations
        self.sequence_split = (not self.is_parallel_a and not expert
                               and parallel.tp_group.size() > 1 and mc.sequence_parallel)
        # A routed expert's weight is reduced over its expert-data-parallel group, not the
        # whole data-parallel one (megatron marks it allreduce=False under EP): its adapter
        # belongs to the same expert, so its factors are marked as the weight is.
        allreduce = getattr(base.weight, "allreduce", True)
        for param in (*lora_a.parameters(), *lora_b.parameters()):
            param.allreduce = allreduce
        self.lora_A[adapter_name] = lora_a.to(base.weight.device)
        self.lora_B[adapter_name] = lora_b.to(base.weight.device)
        self.scaling[adapter_name] = (lora_alpha / math.sqrt(r) if config.use_rslora
                                      else lora_alpha / r)
        self.use_rslora[adapter_name] = config.use_rslora
        self.use_dora[adapter_name] = False
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    @torch.no_grad()
    def init_adapter(self, seed: int) -> None:
        """A as peft initialises it (Kaiming-uniform, a=sqrt(5)) from a generator of its
        own, B = 0 (the model's output is the base model's, exactly)."""
        for name in self.lora_A:
            a, b = self.lora_A[name].weight, self.lora_B[name].weight
            full = torch.empty(a.shape[0], self.in_features, dtype=torch.float32)
            nn.init.kaiming_uniform_(full, a=math.sqrt(5),
                                     generator=torch.Generator().manual_seed(seed))
            if self.is_parallel_a:  # split as the base weight is (an expert's: expert TP)
                group = self.lora_A[name].tp_group
                full = full.chunk(group.size(), dim=1)[group.rank()]
            a.copy_(full)
            b.zero_()

    def forward(self, x: torch.Tensor, *args, **kwargs):
        result, bias = self.base_layer(x, *args, **kwargs)
        if self.disable_adapters or self.merged:
            return result, bias
        if self.base_linear.fused_norm:  # the base's matmul sees norm(x): so does B·A
            x = lora_te.normed_input(self.get_base_layer(), x)
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            h = self.lora_A[name](self._dropout(name, x.to(self.lora_A[name].weight.dtype)))
            h = h[0] if isinstance(h, tuple) else h
            # scaled on the rank-r side: peft's B(A(x))*s costs a pass over [tokens, out]
            # forward and backward; B(A(x)*s) is the same product, bit for bit when s is a
            # power of two (alpha/r = 32/8), else within float rounding
            h = h * self.scaling[name]
            weight = low_rank_add.plain_weight(self.lora_B[name], self._sequence_parallel())
            if weight is not None and result.dtype == h.dtype == weight.dtype:
                result = low_rank_add.add_low_rank(result, h, weight)
                continue
            delta = self.lora_B[name](h)
            delta = delta[0] if isinstance(delta, tuple) else delta
            result = result + delta.to(result.dtype)
        return result, bias

    def _dropout(self, name: str, x: torch.Tensor) -> torch.Tensor:
        dropout = self.lora_dropout[name]
        if not self.sequence_split or isinstance(dropout, nn.Identity):
            return dropout(x)
        from megatron.core import tensor_parallel

        # each TP rank its own stream (megatron's tracker; CPU runs refuse this case,
        # run_config.check_sequence_parallel)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return dropout(x)

    def _sequence_parallel(self) -> bool:
        return bool(getattr(getattr(self.get_base_layer(), "config", None),
                            "sequence_parallel", False))

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """This rank's shard of B·A·scaling, the shard layout of the base weight."""
        return (self.lora_B[adapter].weight @ self.lora_A[adapter].weight) \
            * self.scaling[adapter]

    @torch.no_grad()
    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        from peft.tuners.tuners_utils import check_adapters_to_merge

        for name in check_adapters_to_merge(self, adapter_names):
            weight = self.get_base_layer().weight
            weight.data = weight.data + self.get_delta_weight(name).to(weight.dtype)
            self.merged_adapters.append(name)

    @torch.no_grad()
    def unmerge(self) -> None:
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            weight = self.get_base_layer().weight
            weight.data = weight.data - self.get_delta_weight(name).to(weight.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The base layer's tensors under their checkpoint keys without the adapter (a
        LoRA model reads a full checkpoint's weights), the factors as megatron shards."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        def rows_as_gate_and_up(sd, names):
            # A TP rank's rows of a gated linear_fc1 are [its gate rows; its up rows], not one
            # slice: megatron's MLP stores such a weight as two sharded halves (its
            # sharded_state_dict), which it no longer recognises under our keys.
            if not self.gated_rows:
                return sd
            single = (metadata or {}).get("singleton_local_shards", False)
            return {k: apply_swiglu_sharded_factory(v, sharded_offsets, single)
                    if k in names else v for k, v in sd.items()}

        out = {}
        base = self.get_base_layer().sharded_state_dict(prefix, sharded_offsets, metadata)
        base = rows_as_gate_and_up(base, (prefix + "weight", prefix + "bias"))
        for key, value in base.items():
            out[prefix + "base_layer." + key[len(prefix):]] = value
        for factor in ("lora_A", "lora_B"):
            for name, module in getattr(self, factor).items():
                sub = f"{prefix}{factor}.{name}."
                if hasattr(module, "sharded_state_dict"):
                    sd = module.sharded_state_dict(sub, sharded_offsets, metadata)
                    if factor == "lora_B":
                        sd = rows_as_gate_and_up(sd, (sub + "weight",))
                    out.update(sd)
                else:
                    out.update(make_sharded_tensors_for_checkpoint(
                        module.state_dict(keep_vars=True), sub, {}, sharded_offsets))
        return out

    def __repr__(self) -> str:
        return "lora." + super().__repr__()
