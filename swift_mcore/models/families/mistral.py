"""Mistral (``MistralForCausalLM``): Llama's layout; sliding-window attention when set."""

from .base import Family, sliding_window_check

FAMILY = Family(
    name="mistral",
    model_types=("mistral",),
    architecture="MistralForCausalLM",
    # transformers' MistralConfig defaults for keys a config.json may omit
    defaults={"hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "tie_word_embeddings": False},
    known_keys=frozenset({"sliding_window"}),
    checks=sliding_window_check("sliding_window"),
)
