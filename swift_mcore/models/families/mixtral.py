"""Mixtral (``MixtralForCausalLM``): Mistral's attention, every layer a mixture of experts
whose top-k weights are always renormalised; intermediate_size is each expert's size."""

from .base import Family, MoeKeys, sliding_window_check

FAMILY = Family(
    name="mixtral",
    model_types=("mixtral",),
    architecture="MixtralForCausalLM",
    # transformers' MixtralConfig defaults for keys a config.json may omit
    defaults={"num_experts_per_tok": 2, "hidden_act": "silu",
              "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
              "rope_theta": 1000000.0, "tie_word_embeddings": False},
    known_keys=frozenset({"sliding_window"}),
    checks=sliding_window_check("sliding_window"),
    moe=MoeKeys(experts=("num_local_experts",), expert_ffn="intermediate_size",
                dense_layers=False, norm_topk=None),
)
