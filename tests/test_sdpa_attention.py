"""--attention_backend sdpa computes what megatron's local attention computes, within 1e-5."""

import pytest
import torch

from run_helpers import losses, run_pt, train_records

TOL = 1e-5


def attention_pair(heads=4, groups=2, dropout=0.0, softmax_type="vanilla"):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from swift_mcore.models.sdpa_attention import SdpaAttention
    from swift_mcore.runtime import seed

    seed.set_seed(0)  # megatron's attention forks the tensor-parallel RNG tracker
    config = TransformerConfig(num_layers=1, hidden_size=16 * heads, num_attention_heads=heads,
                               num_query_groups=groups, attention_dropout=dropout,
                               use_cpu_initialization=True, softmax_type=softmax_type)
    build = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                 attention_type="self")
    local, sdpa = DotProductAttention(**build), SdpaAttention(**build)
    if softmax_type == "learnable":
        with torch.no_grad():  # sinks of a few units, so a wrong one shows
            sinks = 2 * torch.randn(heads, generator=torch.Generator().manual_seed(3))
            local.softmax_offset.copy_(sinks)
            sdpa.softmax_offset.copy_(sinks)
    return local, sdpa


def inputs(seq, batch, heads, groups, head_dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Scores of a few units: the softmax is far from uniform, so a wrong mask or scale shows.
    q = (2 * torch.randn(seq, batch, heads, head_dim, generator=g)).requires_grad_()
    k = (2 * torch.randn(seq, batch, groups, head_dim, generator=g)).requires_grad_()
    v = torch.randn(seq, batch, groups, head_dim, generator=g).requires_grad_()
    return q, k, v


def run(module, q, k, v, mask=None):
    for t in (q, k, v):
        t.grad = None
    out = module(q, k, v, mask)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return [out.detach()] + [t.grad.clone() for t in (q, k, v)]


def assert_all_close(expected, got):
    for name, a, b in zip(("output", "dq", "dk", "dv"), expected, got):
        assert a.shape == b.shape, name
        assert float((a - b).abs().max()) <= TOL, (name, float((a - b).abs().max()))


@pytest.mark.parametrize("heads,groups", [(4, 2), (4, 4), (4, 1)])
def test_causal_matches_local_attention(gloo_group, heads, groups):
    local, sdpa = attention_pair(heads=heads, groups=groups)
    q, k, v = inputs(48, 3, heads, groups)
    assert_all_close(run(local, q, k, v), run(sdpa, q, k, v))


def test_explicit_mask_matches_local_attention(gloo_group):
    # megatron's masks mark hidden positions (True); here causal plus two padded keys.
    local, sdpa = attention_pair()
    q, k, v = inputs(32, 2, 4, 2, seed=1)
    mask = torch.triu(torch.ones(32, 32, dtype=torch.bool), diagonal=1).expand(2, 1, 32, 32)
    mask = mask.clone()
    mask[1, :, 5:, 3:5] = True
    assert_all_close(run(local, q, k, v, mask), run(sdpa, q, k, v, mask))


@pytest.mark.parametrize("masked", [False, True])
def test_attention_sinks_match_megatrons_learnable_softmax(gloo_group, masked):
    """gpt-oss's sinks: megatron's softmax_type 'learnable' (SoftmaxOne over the scores and
    a per-head offset) in one SDPA call; outputs and the gradients of q, k, v and the
    offsets within 1e-5, causal and with a packed row's mask."""
    local, sdpa = attention_pair(softmax_type="learnable")
    q, k, v = inputs(32, 2, 4, 2, seed=1)
    mask = None
    if masked:
        mask = torch.triu(torch.ones(32, 32, dtype=torch.bool), diagonal=1).repeat(2, 1, 1, 1)
        mask[1, :, 16:, :16] = True  # two documents in the second row
    expected, got = run(local, q, k, v, mask), run(sdpa, q, k, v, mask)
    assert_all_close(expected, got)
    assert float((local.softmax_offset.grad - sdpa.softmax_offset.grad).abs().max()) <= TOL
    assert float(sdpa.softmax_offset.grad.abs().max()) > 1e-3
    plain = attention_pair()[1]
    assert float((plain(q, k, v, mask).detach() - got[0]).abs().max()) > 1e-2  # sinks count


def test_dropout_is_applied_in_training_only(gloo_group):
    local, sdpa = attention_pair(dropout=0.5)
    q, k, v = inputs(16, 2, 4, 2)
    sdpa.eval()
    local.eval()
    assert_all_close(run(local, q, k, v), run(sdpa, q, k, v))
    evaluated = sdpa(q, k, v, None).detach()
    sdpa.train()
    assert float((sdpa(q, k, v, None).detach() - evaluated).abs().max()) > 1e-3


def build(backend, seq=64):
    from swift_mcore.arguments import RunArguments
    from swift_mcore.models.gpt import build_model
    from swift_mcore.run_config import resolve
    from swift_mcore.runtime import seed

    args = RunArguments.from_flags(num_layers=2, hidden_size=64, num_attention_heads=4,
                                        num_query_groups=2, seq_length=seq,
                                        attention_backend=backend)
    config = resolve(args, world_size=1).complete(256, None, padded_vocab_size=256)
    assert config.attention == backend and config.layer_spec == "local"
    seed.set_seed(7)
    return build_model(config)[0]


def test_whole_model_matches_local_spec(gloo_group):
    from swift_mcore.models.sdpa_attention import SdpaAttention

    local, sdpa = build("local"), build("sdpa")
    assert all(isinstance(layer.self_attention.core_attention, SdpaAttention)
               for layer in sdpa.decoder.layers)
    assert not any(isinstance(layer.self_attention.core_attention, SdpaAttention)
                   for layer in local.decoder.layers)
    # No parameters of its own: the same state dict, so checkpoints are interchangeable.
    assert list(local.state_dict()) == list(sdpa.state_dict())
    sdpa.load_state_dict(local.state_dict())
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(64).expand(2, -1)
    per_token = {}
    for name, model in (("local", local), ("sdpa", sdpa)):
        out = model(tokens, positions, None, labels=tokens)
        out.sum().backward()
        per_token[name] = out.detach()
    assert float((per_token["local"] - per_token["sdpa"]).abs().max()) <= TOL
    grads = dict(local.named_parameters())
    for name, p in sdpa.named_parameters():
        assert float((p.grad - grads[name].grad).abs().max()) <= TOL, name


def test_training_run_matches_local(tmp_path):
    from run_helpers import free_port

    # Its own port: this module's one-rank group may hold the one in os.environ.
    for backend in ("local", "sdpa"):
        run_pt(tmp_path / backend, "--train_iters", "3", "--no_save", "--attention_backend",
               backend, env={"MASTER_PORT": str(free_port())})
    a, b = losses(tmp_path / "local"), losses(tmp_path / "sdpa")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for it in a:
        assert abs(a[it] - b[it]) <= TOL, (it, a[it], b[it])
    norms = [{r["iteration"]: r["grad_norm"] for r in train_records(tmp_path / d)}
             for d in ("local", "sdpa")]
    for it in a:
        assert abs(norms[0][it] - norms[1][it]) <= 1e-4 * max(1.0, norms[0][it])


def test_flag_is_validated():
    from swift_mcore.errors import ArgumentError
    from swift_mcore.arguments import RunArguments

    from swift_mcore.run_config import resolve

    assert RunArguments().model.attention_backend == "auto"
    # auto without CUDA is this module, in megatron's local spec.
    cpu = resolve(RunArguments(), world_size=1, cuda=False)
    assert (cpu.attention, cpu.layer_spec) == ("sdpa", "local")
    with pytest.raises(ArgumentError, match="--attention_backend must be one of auto, local, "
                                            "sdpa, transformer_engine"):
        resolve(RunArguments.from_flags(attention_backend="flash"), world_size=1)
    with pytest.raises(ArgumentError, match="--attention_backend transformer_engine needs CUDA "
                                            "and Transformer Engine"):
        resolve(RunArguments.from_flags(attention_backend="transformer_engine"),
                world_size=1, cuda=False)
