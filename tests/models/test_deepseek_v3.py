"""DeepSeek-V3 (multi-latent attention, YaRN, sigmoid group-limited routing with an expert
bias, shared experts, a dense first layer): a tiny random folder whose routing spreads tokens
over experts and groups and whose norms and biases are off their init gives transformers'
logits; HF -> swift-mcore -> HF is bit-identical; what megatron cannot express is named."""

import json

import pytest
import torch

import hf_helpers as H
from swift_mcore.errors import ArgumentError

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
        "rope_theta": 10000.0}
# eight experts in four groups, two groups per token, top-2; the first layer dense
DEEPSEEK = dict(n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                moe_intermediate_size=32, n_group=4, topk_group=1, first_k_dense_replace=1,
                q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=24, num_key_value_heads=4, routed_scaling_factor=2.5,
                rope_parameters=YARN, num_hidden_layers=3)


def make_deepseek(path, **overrides):
    """A random model with every norm weight and the routers' correction bias off init."""
    model = H.make_model(str(path), "deepseek_v3", **{**DEEPSEEK, **overrides})
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn(buffer.shape, generator=generator))
    model.save_pretrained(str(path))
    return model


def convert(source, out, direction, **flags):
    from swift_mcore.arguments.export import ExportArguments
    from swift_mcore.export import run

    args = ExportArguments(model=str(source), output_dir=str(out), **{direction: True}, **flags)
    return run(args.validate(), log=lambda line: None)


@pytest.mark.parametrize("q_lora_rank", [48, None])
def test_logits_match_and_round_trip_is_bit_identical(tmp_path, gloo_group, q_lora_rank):
    from swift_mcore.loaded_model import forward_logits, load_model

    source = tmp_path / "hf"
    hf_model = make_deepseek(source, q_lora_rank=q_lora_rank)
    ids = H.tokens()
    with torch.no_grad():  # the routing spreads: every expert is some token's choice
        router = hf_model.model.layers[2].mlp.gate
        hidden = torch.randn(128, 64, generator=torch.Generator().manual_seed(2))
        _, _, chosen = router(hidden)
    assert len(set(chosen.flatten().tolist())) == 8

    loaded = load_model(str(source), log=lambda line: None)
    ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    theirs = H.hf_logits(str(source), ids)
    assert (ours - theirs).abs().max() <= 1e-4
    m = loaded.config.model
    assert (m.model_type, m.num_experts, m.moe_router_topk, m.moe_layer_freq) == (
        "deepseek_v3", 8, 2, "[0,1,1]")
    assert m.multi_latent_attention and m.rope_type == "yarn" and m.q_lora_rank == q_lora_rank

    checkpoint, back = tmp_path / "mcore", tmp_path / "back"
    assert convert(source, checkpoint, "to_mcore",
                   test_convert_precision=True)["max_logit_difference"] <= 1e-4
    convert(checkpoint, back, "to_hf")
    original, exported = H.safetensors_state(str(source)), H.safetensors_state(str(back))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    config = json.loads((back / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["first_k_dense_replace"] == 1
    assert H.hf_logits(str(back), ids).sub(theirs).abs().max() == 0
