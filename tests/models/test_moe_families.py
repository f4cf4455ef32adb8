"""Mixture-of-experts families (Qwen2-MoE, Qwen3-MoE, Mixtral): tiny random models whose
routing spreads tokens over the experts and whose norms and biases are off their init give
transformers' logits; HF -> swift-mcore checkpoint -> HF is bit-identical; infer runs; the
config's router settings land on the MoE flags, and what megatron cannot express is named."""


import pytest
import torch

import hf_helpers as H
from swift_mcore.errors import ArgumentError

# model_type, config overrides: two layers with four experts, top-2
MOE_FAMILIES = {
    # a dense first layer (mlp_only_layers), the gated shared expert, top-k not normalised
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, mlp_only_layers=[0],
                                    norm_topk_prob=False)),
    # the top-k weights renormalised
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, norm_topk_prob=True)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=None)),
}


def make_moe(path, family, **overrides):
    """A random model with every norm weight and bias moved off its init value."""
    model_type, extra = MOE_FAMILIES[family]
    model = H.make_model(str(path), model_type, **{**extra, **overrides})
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(str(path))
    return model


convert = H.convert


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_logits_match_and_round_trip_is_bit_identical(tmp_path, gloo_group, family):
    from swift_mcore.loaded_model import forward_logits, load_model

    source = tmp_path / "hf"
    hf_model = make_moe(source, family)
    ids = H.tokens()
    with torch.no_grad():  # the routing really spreads: every expert is some token's first
        router = hf_model(ids, output_router_logits=True).router_logits[-1]
    assert len(set(router.argmax(-1).flatten().tolist())) == 4

    loaded = load_model(str(source), log=lambda line: None)
    ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    theirs = H.hf_logits(str(source), ids)
    assert (ours - theirs).abs().max() <= 1e-4, family
    m = loaded.config.model
    assert (m.model_type, m.num_experts, m.moe_router_topk) == (family, 4, 2)

    config = H.check_round_trip(source, tmp_path)
    back = tmp_path / "back"
    assert config["model_type"] == family and config["num_experts_per_tok"] == 2
    assert H.hf_logits(str(back), ids).sub(theirs).abs().max() == 0


def test_router_settings_come_from_config_json(tmp_path):
    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve

    make_moe(tmp_path / "q2", "qwen2_moe", decoder_sparse_step=2, mlp_only_layers=[],
             router_aux_loss_coef=0.02, num_hidden_layers=4)
    m = resolve(RunArguments.from_flags(model=str(tmp_path / "q2")), world_size=1).model
    assert m.moe_layer_freq == "[0,1,0,1]" and m.moe_router_pre_softmax
    assert m.moe_shared_expert_intermediate_size == 48 and m.moe_shared_expert_gate
    assert m.moe_aux_loss_coeff == 0.02 and m.add_qkv_bias
    # the coefficient is a finetuning choice: an explicit flag wins over the config
    m = resolve(RunArguments.from_flags(model=str(tmp_path / "q2"), moe_aux_loss_coeff=0.0),
                world_size=1).model
    assert m.moe_aux_loss_coeff == 0.0
    with pytest.raises(ArgumentError, match="must divide --num_experts"):
        resolve(RunArguments.from_flags(model=str(tmp_path / "q2"),
                                             expert_model_parallel_size=3,
                                             global_batch_size=12), world_size=3)


def test_what_megatron_cannot_express_is_named(tmp_path):
    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve

    make_moe(tmp_path / "mx", "mixtral")
    H.edit_config(str(tmp_path / "mx"), router_jitter_noise=0.1)
    with pytest.raises(ArgumentError, match="router_jitter_noise 0.1"):
        resolve(RunArguments.from_flags(model=str(tmp_path / "mx")), world_size=1)
    H.edit_config(str(tmp_path / "mx"), router_jitter_noise=0.0, num_experts_per_tok=5)
    with pytest.raises(ArgumentError, match="num_experts_per_tok 5"):
        resolve(RunArguments.from_flags(model=str(tmp_path / "mx")), world_size=1)


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_infer_runs_a_moe_folder(tmp_path, gloo_group, capsys, family):
    """`swift-mcore infer` on each family's folder (its command without the process
    group's shutdown): the greedy tokens are transformers'."""
    make_moe(tmp_path / "hf", family)
    H.check_infer_is_greedy(tmp_path / "hf", capsys)
