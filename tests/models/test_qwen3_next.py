"""Qwen3-Next: a tiny random qwen3_next folder (three gated delta-net layers and one gated
full-attention layer, routed experts with a gated shared expert, every weight off its init)
gives transformers' logits; HF -> checkpoint -> HF is bit-identical; infer gives
transformers' greedy tokens; what megatron cannot express is named."""

import pytest
import torch

import hf_helpers as H
from swift_mcore.errors import ArgumentError

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU delta rule")

NEXT = dict(num_hidden_layers=4, head_dim=16, partial_rotary_factor=0.5,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
            # half the other families' width: with 0.2 the delta nets' states grow large
            # enough that float32 rounding alone (transformers' and ours) nears 1e-4 by
            # 200 tokens
            initializer_range=0.1)


def make_next(path, **overrides):
    """A random qwen3_next model with every weight moved off its init (norms start at 0,
    dt_bias at 1, the router at 0)."""
    model = H.make_model(str(path), "qwen3_next", **{**NEXT, **overrides})
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "dt_bias" in name or "A_log" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def next_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next") / "hf"
    make_next(path)
    return path


def test_logits_match_and_round_trip_is_bit_identical(tmp_path, gloo_group, next_folder):
    from swift_mcore.loaded_model import forward_logits, load_model

    ids = H.tokens(length=80)  # over one 64-token chunk of the delta rule
    loaded = load_model(str(next_folder), log=lambda line: None)
    m = loaded.config.model
    assert (m.model_type, m.linear_attention_freq, m.attention_output_gate,
            m.rotary_percent) == ("qwen3_next", "[1,1,1,0]", True, 0.5)
    theirs = H.hf_logits(str(next_folder), ids)
    ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    assert (ours - theirs).abs().max() <= 1e-4
    H.check_round_trip(next_folder, tmp_path)


def test_infer_is_transformers_greedy(gloo_group, next_folder, capsys):
    H.check_infer_is_greedy(next_folder, capsys)


def test_packing_is_refused_by_name(next_folder, tmp_path):
    """megatron's GatedDeltaNet ignores the packed rows' mask: refused before any work."""
    from swift_mcore.arguments.sft import SftArguments
    from swift_mcore.run_config import resolve

    data = tmp_path / "train.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, '
                    '{"role": "assistant", "content": "ho"}]}\n')
    args = SftArguments.from_flags(model=str(next_folder), dataset=[str(data)], packing=True)
    with pytest.raises(ArgumentError, match="--packing with gated delta-net layers"):
        resolve(args, world_size=1)
