"""What a layer keeps for the backward pass: no more than its shape needs, gradients exact."""

import torch

SEQ, BATCH, HIDDEN, FFN, HEADS, GROUPS = 64, 2, 64, 160, 4, 2


def build(**flags):
    from swift_mcore.arguments import RunArguments
    from swift_mcore.models.gpt import build_model
    from swift_mcore.run_config import resolve
    from swift_mcore.runtime import seed

    args = RunArguments.from_flags(
        num_layers=2, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        num_query_groups=GROUPS, seq_length=SEQ, swiglu=True, normalization="RMSNorm",
        position_embedding_type="rope", **flags)
    config = resolve(args, world_size=1, cuda=False).complete(256, None,
                                                              padded_vocab_size=256)
    seed.set_seed(5)
    return build_model(config)[0]


def saved_bytes_of_first_layer(model, tokens):
    """Bytes of the storages autograd keeps for backward while layer 0 runs (parameters
    left out, each storage once, in full: a view keeps all of its storage)."""
    layer = model.decoder.layers[0]
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, inside, total = set(), [False], [0]

    def pack(t):
        storage = t.untyped_storage()
        if inside[0] and storage.data_ptr() not in seen | parameters:
            seen.add(storage.data_ptr())
            total[0] += storage.nbytes()
        return t

    hooks = [layer.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, True)),
             layer.register_forward_hook(lambda m, a, o: inside.__setitem__(0, False))]
    positions = torch.arange(SEQ).expand(BATCH, -1)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(tokens, positions, None, labels=tokens)
    finally:
        for hook in hooks:
            hook.remove()
    return total[0], out


def test_a_layer_keeps_what_its_shape_needs(gloo_group):
    model = build()
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    got, _ = saved_bytes_of_first_layer(model, tokens)
    t, head_dim = SEQ * BATCH, HIDDEN // HEADS
    q, kv = HEADS * head_dim, GROUPS * head_dim
    floats = t * (
        2 * (2 * HIDDEN + 1)      # two RMSNorms: input, 1/rms, normalised input
        + HIDDEN + HIDDEN         # the inputs of linear_qkv and linear_fc1
        + 2 * q + 2 * kv + HEADS  # SDPA: rotated q and k, v, output, log-sum-exp
        + 2 * FFN + FFN           # SwiGLU: the fc1 output; linear_fc2's input
    ) + 2 * SEQ * head_dim        # RoPE's cos and sin: one pair for q, k and all layers
    # Without models/swiglu.py 2 x t x FFN more floats (silu's output, megatron's copy of
    # `up`); without the copy of v in SdpaAttention the whole q+k+v output of linear_qkv.
    assert got == 4 * floats, (got, 4 * floats)  # exactly: nothing kept twice or in excess


def test_swiglu_is_megatrons_glu_bit_for_bit(gloo_group):
    import torch.nn.functional as F

    from swift_mcore.models.swiglu import SwiGLU

    g = torch.Generator().manual_seed(2)
    x = (3 * torch.randn(SEQ, BATCH, 2 * FFN, generator=g)).requires_grad_()
    grad = torch.randn(SEQ, BATCH, FFN, generator=g)
    ours = SwiGLU()(x)
    (ours_grad,) = torch.autograd.grad(ours, x, grad)
    gate, up = torch.chunk(x, 2, dim=-1)  # megatron's MLP.forward glu at offset 0
    theirs = F.silu(gate) * (up + 0.0)
    (theirs_grad,) = torch.autograd.grad(theirs, x, grad)
    assert torch.equal(ours, theirs) and torch.equal(ours_grad, theirs_grad)


def test_model_gradients_equal_megatrons_own_mlp(gloo_group):
    import dataclasses

    from megatron.core.transformer.mlp import MLP

    from swift_mcore.models.swiglu import SwiGLU

    ours = build()
    assert all(isinstance(layer.mlp.activation_func, SwiGLU) for layer in ours.decoder.layers)
    theirs = build()
    for layer in theirs.decoder.layers:  # megatron's own unfused glu in MLP.forward
        assert isinstance(layer.mlp, MLP)
        layer.mlp.config = dataclasses.replace(layer.mlp.config, use_te_activation_func=False)
        del layer.mlp.activation_func  # the submodule; megatron's glu calls config's silu
        layer.mlp.activation_func = layer.mlp.config.activation_func
    # No parameters of its own: the same (sharded) state dict, checkpoints interchangeable.
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert sorted(ours.sharded_state_dict()) == sorted(theirs.sharded_state_dict())
    theirs.load_state_dict(ours.state_dict())
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(SEQ).expand(BATCH, -1)
    outs = []
    for model in (ours, theirs):
        out = model(tokens, positions, None, labels=tokens)
        out.sum().backward()
        outs.append(out.detach())
    assert torch.equal(outs[0], outs[1])
    grads = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(p.grad, grads[name].grad), name
