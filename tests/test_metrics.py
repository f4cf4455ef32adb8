"""Model FLOPs per token: 6 x the model's matmul weights + 12 x layers x seq x attention width."""

import pytest


@pytest.mark.parametrize("flags", [
    dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=32),
    dict(num_layers=3, hidden_size=96, num_attention_heads=6, num_query_groups=None,
         seq_length=128, swiglu=False, kv_channels=8),
])
def test_flops_per_token_counts_the_built_models_matmuls(gloo_group, flags):
    from swift_mcore.arguments import PretrainArguments
    from swift_mcore.models.gpt import build_model
    from swift_mcore.run_config import resolve
    from swift_mcore.runtime import seed
    from swift_mcore.training.metrics import flops_per_token

    args = resolve(PretrainArguments.from_flags(**flags), world_size=1, cuda=False).complete(
        256, None, padded_vocab_size=256)
    seed.set_seed(0)
    model = build_model(args)[0]
    # Every 2-D weight but the input embedding (a lookup, not a matmul) is one multiply-add
    # per token and entry.
    matmul = sum(p.numel() for name, p in model.named_parameters()
                 if p.dim() == 2 and "word_embeddings" not in name)
    m = args.model
    width = m.num_attention_heads * (m.kv_channels or m.hidden_size // m.num_attention_heads)
    expected = 6 * matmul + 12 * m.num_layers * m.seq_length * width
    assert flops_per_token(args) == pytest.approx(expected, rel=1e-12)
