"""What DeepSeek-V3 and GLM-4.5 share: config.json <-> flags of a sigmoid router whose expert
bias (``e_score_correction_bias``) steers the choice only, group-limited top-k, routed
weights times ``routed_scaling_factor``, ungated shared experts (``n_shared_experts`` times
the expert size) and the first ``first_k_dense_replace`` layers dense."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from .base import Family, InvalidConfig, MoeKeys, UnsupportedConfig

# keys read here beyond base.MAPPED_KEYS and MoeKeys'
KEYS = frozenset({
    "n_shared_experts", "routed_scaling_factor", "n_group", "topk_group",
    "first_k_dense_replace", "num_nextn_predict_layers", "moe_layer_freq", "scoring_func",
    "topk_method", "ep_size", "seq_aux", "aux_loss_alpha"})
# the flags every model of such a family has
FIXED = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}
MOE = MoeKeys(experts=("n_routed_experts",), expert_ffn="moe_intermediate_size",
              dense_layers=False, norm_topk=True, softmax_router=False)


@dataclass(frozen=True)
class SigmoidMoeFamily(Family):
    """base.Family plus the router and layer pattern above. A subclass maps its attention
    in ``attention_values`` (and writes it back in ``hf_config``)."""

    def read_keys(self) -> frozenset:
        return super().read_keys() | KEYS

    def attention_values(self, config: Dict[str, Any], get) -> tuple:
        """(ModelArguments values, problems) the generic mapping does not give; the
        config.json given to base.Family is ``generic_config``'s."""
        return {}, []

    def generic_config(self, config: Dict[str, Any]) -> Dict[str, Any]:
        return config

    def model_values(self, config: Dict[str, Any], model_args: Any) -> Dict[str, Any]:
        def get(key: str) -> Any:
            value = config.get(key)
            return self.defaults.get(key) if value is None else value

        from .. import mtp

        mtp.check_flag(self, model_args)  # its MTP layers (past num_hidden_layers)
        problems: List[str] = []
        try:
            values = super().model_values(self.generic_config(config), model_args)
        except InvalidConfig:
            raise
        except UnsupportedConfig as err:
            values, problems = {}, [str(err)]
        if get("scoring_func") not in (None, "sigmoid"):
            problems.append(f"scoring_func {config['scoring_func']!r} (only 'sigmoid')")
        if get("topk_method") not in (None, "noaux_tc"):
            problems.append(f"topk_method {config['topk_method']!r} (only 'noaux_tc')")
        if not get("norm_topk_prob"):
            problems.append("norm_topk_prob false (megatron's sigmoid router renormalises its "
                            "top-k weights)")
        layers, topk = int(config["num_hidden_layers"]), int(get("num_experts_per_tok"))
        experts = int(get("n_routed_experts"))
        groups, chosen = int(get("n_group")), int(get("topk_group"))
        if experts % groups:
            problems.append(f"n_group {groups} does not divide n_routed_experts {experts}")
        elif chosen > groups or topk > chosen * (experts // groups):
            problems.append(f"topk_group {chosen} (1 to n_group {groups}, its groups holding "
                            f"num_experts_per_tok {topk} experts)")
        grouped = 1 < groups and chosen < groups
        if grouped and topk // chosen != 2:
            # transformers scores a group by its two best experts, megatron by its
            # top (top-k / chosen groups)
            problems.append(f"num_experts_per_tok {topk} with topk_group {chosen} (megatron "
                            f"scores a group by its top num_experts_per_tok // topk_group "
                            f"experts, transformers by its top 2: only a ratio of 2)")
        dense = int(get("first_k_dense_replace"))
        if dense > layers:
            problems.append(f"first_k_dense_replace {dense} (at most num_hidden_layers "
                            f"{layers})")
        mtp_layers = getattr(model_args, "mtp_num_layers", None)
        if mtp_layers and dense >= layers:
            # megatron builds an MTP layer as its last decoder layer (dense here); the
            # folder's, past first_k_dense_replace, are mixtures of experts
            problems.append(f"first_k_dense_replace {dense} (every layer dense) with "
                            f"--mtp_num_layers {mtp_layers}: a {self.name} MTP layer is a "
                            f"mixture of experts, megatron's would be dense")
        attention, attention_problems = self.attention_values(config, get)
        problems += attention_problems
        if problems:
            raise UnsupportedConfig("; ".join(problems))
        shared = int(get("n_shared_experts"))
        values.update(attention)
        values.update(
            num_experts=experts,
            moe_layer_freq="[" + ",".join(["0"] * dense + ["1"] * (layers - dense)) + "]",
            moe_shared_expert_intermediate_size=shared * int(get("moe_intermediate_size"))
            or None,
            moe_shared_expert_gate=False,
            moe_router_pre_softmax=False,
            moe_router_num_groups=groups if grouped else None,
            moe_router_group_topk=chosen if grouped else None,
            moe_router_topk_scaling_factor=float(get("routed_scaling_factor")),
        )
        return values

    def representation_problems(self, m: Any) -> List[str]:
        from ...arguments.model import moe_layer_pattern

        own = ("--moe_layer_freq", "--moe_shared_expert_inter")
        problems = [p for p in super().representation_problems(m) if not p.startswith(own)]
        if getattr(m, "num_experts", None) is None:
            return problems
        pattern = moe_layer_pattern(m)
        if pattern != sorted(pattern):
            problems.append(f"--moe_layer_freq {m.moe_layer_freq} (a {self.name} model's dense "
                            f"layers are its first ones)")
        shared, ffn = m.moe_shared_expert_intermediate_size, m.moe_ffn_hidden_size
        if shared and (m.moe_shared_expert_gate or shared % (ffn or m.ffn_hidden_size)):
            problems.append(f"--moe_shared_expert_intermediate_size {shared} (ungated, a "
                            f"multiple of --moe_ffn_hidden_size in a {self.name} model)")
        if m.moe_router_num_groups and m.moe_router_topk // m.moe_router_group_topk != 2:
            problems.append(f"--moe_router_topk {m.moe_router_topk} with "
                            f"--moe_router_group_topk {m.moe_router_group_topk} (transformers "
                            f"scores a group by its top 2 experts)")
        return problems

    def hf_config(self, m: Any, vocab_size: int, base: Optional[Dict[str, Any]] = None
                  ) -> Dict[str, Any]:
        from ...arguments.model import moe_layer_pattern

        config = super().hf_config(m, vocab_size, base)
        config.pop("router_aux_loss_coef", None)
        ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
        config.update(
            n_shared_experts=(m.moe_shared_expert_intermediate_size or 0) // ffn,
            n_group=m.moe_router_num_groups or 1, topk_group=m.moe_router_group_topk or 1,
            routed_scaling_factor=m.moe_router_topk_scaling_factor or 1.0,
            first_k_dense_replace=moe_layer_pattern(m).count(0), norm_topk_prob=True,
            num_nextn_predict_layers=m.mtp_num_layers or 0)
        # DeepSeek-V3's sequence-wise auxiliary loss (training only) has its own keys
        if m.moe_router_load_balancing_type == "seq_aux_loss":
            config.update(seq_aux=True, aux_loss_alpha=m.moe_aux_loss_coeff)
        return config
