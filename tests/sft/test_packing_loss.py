"""A packed row gives every conversation the loss it has alone: the mask never leaks."""

import numpy as np
import pytest
import torch

TOL = 1e-5
SEQ = 64
VOCAB = 256


def build(backend, position_embedding):
    from swift_mcore.arguments import RunArguments
    from swift_mcore.models.gpt import build_model
    from swift_mcore.run_config import resolve
    from swift_mcore.runtime import seed

    args = RunArguments.from_flags(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        seq_length=SEQ, attention_backend=backend,
        position_embedding_type=position_embedding)
    config = resolve(args, world_size=1).complete(VOCAB, None, padded_vocab_size=VOCAB)
    seed.set_seed(11)
    return build_model(config)[0].eval()


def packed_row(lengths):
    """One SftDataset row holding conversations of these token counts (random ids, every
    token after the first few trained on), padded to SEQ by collate."""
    from swift_mcore.data.packing import pack
    from swift_mcore.data.sft_datasets import SftDataset, _flat

    g = np.random.default_rng(5)
    parts = []
    for n in lengths:
        targets = np.zeros(n, bool)
        targets[3:] = True
        parts.append((g.integers(2, VOCAB, n).astype(np.int32), targets))
    encoded = _flat(parts)
    rows = pack(encoded.positions(), SEQ)
    assert len(rows) == 1, rows  # they fit in one row together
    ds = SftDataset(encoded, rows, SEQ, pad_id=1, packed=True, pad_to_seq_length=True,
                    fingerprint="test")
    return encoded, ds.collate([ds[0]])


def per_token_loss(model, tokens, positions, labels, mask=None):
    with torch.no_grad():
        return model(tokens, positions, mask, labels=labels)


@pytest.mark.parametrize("backend", ["local", "sdpa"])
@pytest.mark.parametrize("position_embedding", ["rope", "learned_absolute"])
def test_packed_losses_equal_each_conversation_alone(gloo_group, backend, position_embedding):
    from swift_mcore.data.packing import block_causal_mask

    model = build(backend, position_embedding)
    lengths = [21, 17, 13]  # 18 + 16 + 12 positions... and padding to 64
    encoded, batch = packed_row(lengths)
    assert batch["tokens"].shape == (1, SEQ)
    mask = block_causal_mask(batch["segment_ids"])
    packed = per_token_loss(model, batch["tokens"], batch["position_ids"], batch["labels"],
                            mask)[0]
    leaky = per_token_loss(model, batch["tokens"], batch["position_ids"], batch["labels"])[0]

    start = 0
    for k, n in enumerate(lengths):
        ids = torch.from_numpy(encoded.sample(k)[0]).long()
        alone = per_token_loss(model, ids[None, :-1], torch.arange(n - 1)[None],
                               ids[None, 1:])[0]
        got = packed[start:start + n - 1]
        assert got.shape == alone.shape
        assert float((got - alone).abs().max()) <= TOL, (k, float((got - alone).abs().max()))
        weights = batch["loss_mask"][0, start:start + n - 1]
        assert float(((got - alone) * weights).sum().abs()) <= TOL * n
        if k:  # without the mask, later conversations see earlier ones: the test can fail
            assert float((leaky[start:start + n - 1] - alone).abs().max()) > 1e-3
        start += n - 1
    # Padding is its own segment and trains nothing.
    assert float(batch["loss_mask"][0, start:].sum()) == 0.0
    assert batch["num_tokens"].item() == sum(n - 1 for n in lengths)
