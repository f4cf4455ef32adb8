"""LoRA on the Transformer Engine spec, on the CPU: megatron's TE linears are stood in for
by torch modules with their interface (the attributes, forward signature, returned pair and
TP sharding of megatron's TE wrappers; the fused-norm linear normalises its input itself,
the layer's own norm is an identity), registered as TE's classes are. The adapted TE-spec
model computes the local spec's function and gradients, merges, and writes a checkpoint the
local spec reads (what export does). The real TE classes run in benchmarks/gpu_check.py."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from swift_mcore.arguments import RunArguments
from swift_mcore.errors import ArgumentError
from swift_mcore.models import lora_te
from swift_mcore.run_config import resolve

SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
             seq_length=32, vocab_size=256, attention_backend="sdpa")


class StandInTE(nn.Module):
    """megatron's TE linear wrappers (TEColumnParallelLinear, TERowParallelLinear,
    TELayerNormColumnParallelLinear) in torch: TE's attribute names, this rank's
    in/out_features, forward(x) -> (out, bias or None), the weight sharded over TP."""

    parallel_mode = "column"
    fused_norm = False

    def __init__(self, input_size, output_size, *, config, init_method, bias, skip_bias_add,
                 **_):
        from megatron.core import parallel_state

        super().__init__()
        self.config = config
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        column = self.parallel_mode == "column"
        self.in_features = input_size if column else input_size // self.tp_size
        self.out_features = output_size // self.tp_size if column else output_size
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features))
        init_method(self.weight.data)
        self.use_bias, self.te_return_bias = bias, skip_bias_add and bias
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_features))
        else:
            self.bias = torch.Tensor()  # TE's empty bias
        if self.fused_norm:
            self.normalization = config.normalization
            self.eps = config.layernorm_epsilon
            self.zero_centered_gamma = config.layernorm_zero_centered_gamma
            self.layer_norm_weight = nn.Parameter(
                torch.full((input_size,), float(not self.zero_centered_gamma)))
            self.layer_norm_bias = (nn.Parameter(torch.zeros(input_size))
                                    if self.normalization == "LayerNorm" else None)

    def norm(self, x):  # TE's formulas, written out
        gamma = self.layer_norm_weight + (1 if self.zero_centered_gamma else 0)
        if self.normalization == "RMSNorm":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * gamma
        mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        return (x - mean) * torch.rsqrt(var + self.eps) * gamma + self.layer_norm_bias

    def forward(self, x):
        from megatron.core import tensor_parallel

        if self.fused_norm:
            x = self.norm(x)
        if self.parallel_mode == "column":
            x = tensor_parallel.copy_to_tensor_model_parallel_region(x)
        out = F.linear(x, self.weight)
        if self.parallel_mode == "row":
            out = tensor_parallel.reduce_from_tensor_model_parallel_region(out)
        if self.use_bias and not self.te_return_bias:
            out = out + self.bias
        return (out, self.bias) if self.te_return_bias else (out, None)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axes = {"weight": 0, "bias": 0} if self.parallel_mode == "column" else {"weight": 1}
        return make_sharded_tensors_for_checkpoint(self.state_dict(keep_vars=True), prefix,
                                                   axes, sharded_offsets)


class StandInColumn(StandInTE):
    pass


class StandInRow(StandInTE):
    parallel_mode = "row"


class StandInLayerNormColumn(StandInTE):
    fused_norm = True


STAND_INS = {StandInLayerNormColumn: lora_te.NORM_COLUMN, StandInColumn: lora_te.COLUMN,
             StandInRow: lora_te.ROW}


@pytest.fixture
def te_classes(monkeypatch):
    """The stand-ins recognised as Transformer Engine's linears are."""
    monkeypatch.setattr(lora_te, "linear_kinds", lambda: STAND_INS)


def te_model(config, monkeypatch):
    """The GPTModel of ``config`` with the TE spec's linears: fused norms in linear_qkv and
    linear_fc1, identity input_layernorm/pre_mlp_layernorm (the final norm stays)."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from swift_mcore.models import gpt

    spec = copy.deepcopy(gpt.layer_spec(config))
    final_norm = spec.submodules.input_layernorm
    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = IdentityOp
    layer.self_attention.submodules.linear_qkv = StandInLayerNormColumn
    layer.self_attention.submodules.linear_proj = StandInRow
    layer.mlp.submodules.linear_fc1 = StandInLayerNormColumn
    layer.mlp.submodules.linear_fc2 = StandInRow
    block = TransformerBlockSubmodules(layer_specs=[spec] * config.model.num_layers,
                                       layer_norm=final_norm)
    monkeypatch.setattr(gpt, "block_spec", lambda *_: block)
    return gpt.build_model(config)[0]


def lora_config(**flags):
    return resolve(RunArguments.from_flags(**SHAPE, tuner_type="lora", lora_rank=4,
                                                lora_alpha=16, lora_dropout=0.0, **flags),
                   world_size=1).complete(256, None)


def randomize_b(model):
    """Nonzero B, drawn per global layer name (the same in both models)."""
    import zlib

    from swift_mcore.models.lora_layer import LoraParallelLinear

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LoraParallelLinear):
                b = module.lora_B["default"].weight
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)


def loss_and_grads(model, tokens):
    """This rank's logits (its vocabulary shard) and the adapters' gradients of the mean
    next-token loss (megatron's vocabulary-parallel cross entropy)."""
    model.zero_grad(set_to_none=True)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        logits = model(input_ids=tokens, position_ids=positions, attention_mask=None)
    labels = torch.roll(tokens, -1, dims=1)
    model(input_ids=tokens, position_ids=positions, attention_mask=None,
          labels=labels).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logits, grads


def test_lora_on_the_te_spec_equals_the_local_spec(gloo_group, te_classes, monkeypatch,
                                                   tmp_path):
    from swift_mcore.checkpointing import io
    from swift_mcore.loaded_model import forward_logits
    from swift_mcore.models import lora
    from swift_mcore.models.convert import Layout, canonical
    from swift_mcore.models.gpt import build_model
    from swift_mcore.models.lora_layer import LoraParallelLinear
    from swift_mcore.runtime import seed

    config = lora_config()
    seed.set_seed(1)
    local = build_model(config)[0]
    te = te_model(config, monkeypatch)
    # the same base weights: each TE name read under its local spelling (models/convert.py)
    weights = local.state_dict()
    te.load_state_dict({k: weights[canonical(k)] for k in te.state_dict()})
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    base = forward_logits(te, tokens)
    assert torch.allclose(base, forward_logits(local, tokens), atol=1e-5)
    for model in (local, te):
        lora.apply(config, [model])
    layers = [m for m in te.modules() if isinstance(m, LoraParallelLinear)]
    assert len(layers) == 8 and all(isinstance(m.base_layer, StandInTE) for m in layers)
    assert torch.equal(forward_logits(te, tokens), base)  # B = 0: the base model exactly
    assert {n for n, p in te.named_parameters() if p.requires_grad} == \
        {n for n, p in local.named_parameters() if p.requires_grad}
    randomize_b(local)
    randomize_b(te)
    logits, grads = loss_and_grads(te, tokens)
    want_logits, want_grads = loss_and_grads(local, tokens)
    assert (logits - base).abs().max() > 1e-3
    # the adapters of linear_qkv/linear_fc1 see the normalised input, as the base's matmul
    assert (logits - want_logits).abs().max() < 1e-5
    for name, grad in want_grads.items():
        assert torch.allclose(grads[name], grad, rtol=1e-4, atol=1e-7), name

    # A TE-spec LoRA checkpoint holds the local spec's keys and shapes: export and infer
    # rebuild the local spec and read it (loaded_model), here through dist_checkpointing.
    reference = lora.peft_adapter(local, config.tuner, Layout.from_model_args(
        config.model, config.padded_vocab_size), None)
    with torch.no_grad():
        for module in local.modules():
            if isinstance(module, LoraParallelLinear):
                module.lora_A["default"].weight.zero_()
                module.lora_B["default"].weight.zero_()
    (tmp_path / "ckpt").mkdir()
    io.save(io.sharded_state_dict([te], None, False, False), str(tmp_path / "ckpt"))
    io.restore_model([local], io.load(io.sharded_state_dict([local], None, False, True),
                                      str(tmp_path / "ckpt")))
    assert torch.allclose(forward_logits(local, tokens), logits, atol=1e-5)
    config_json, tensors = lora.peft_adapter(te, config.tuner, Layout.from_model_args(
        config.model, config.padded_vocab_size), None)
    assert config_json == reference[0] and tensors.keys() == reference[1].keys()
    assert all(torch.equal(tensors[k], reference[1][k]) for k in tensors)

    # merged in place: W + B·A·alpha/r in the TE base, the same function
    qkv = te.decoder.layers[0].self_attention.linear_qkv
    a, b = qkv.lora_A["default"].weight, qkv.lora_B["default"].weight
    expected = qkv.base_layer.weight.detach() + (b @ a).detach() * (16 / 4)
    lora.merge_and_unload(te)
    assert isinstance(te.decoder.layers[0].self_attention.linear_qkv, StandInLayerNormColumn)
    assert torch.equal(te.decoder.layers[0].self_attention.linear_qkv.weight, expected)
    assert torch.allclose(forward_logits(te, tokens), logits, atol=1e-5)


@pytest.mark.parametrize("normalization, zero_centered", [("LayerNorm", True),
                                                          ("RMSNorm", False)])
def test_the_fused_norm_linear_adapter_sees_the_normalised_input(
        gloo_group, te_classes, normalization, zero_centered):
    """One LayerNormLinear with its adapter against norm -> (W + B·A·scale) in torch."""
    from peft import LoraConfig, inject_adapter_in_model
    from megatron.core.transformer import TransformerConfig

    from swift_mcore.models.lora_layer import LoraParallelLinear

    tc = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                           normalization=normalization, layernorm_epsilon=1e-5,
                           layernorm_zero_centered_gamma=zero_centered,
                           use_cpu_initialization=True)
    holder = nn.Module()
    holder.linear = StandInLayerNormColumn(16, 24, config=tc, init_method=nn.init.normal_,
                                           bias=True, skip_bias_add=False)
    with torch.no_grad():
        holder.linear.layer_norm_weight.normal_(0, 0.3)
        if holder.linear.layer_norm_bias is not None:
            holder.linear.layer_norm_bias.normal_(0, 0.3)
    cfg = LoraConfig(r=3, lora_alpha=6, target_modules=["linear"], lora_dropout=0.0)
    cfg._register_custom_module({StandInLayerNormColumn: LoraParallelLinear})
    inject_adapter_in_model(cfg, holder)
    layer = holder.linear
    assert isinstance(layer, LoraParallelLinear) and (layer.in_features, layer.out_features) \
        == (16, 24)
    layer.init_adapter(7)
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 0.1)
    x = torch.randn(5, 16, requires_grad=True)
    out, bias = layer(x)
    assert bias is None
    base = layer.base_layer
    norm = (F.layer_norm(x, (16,), 1 + base.layer_norm_weight, base.layer_norm_bias, 1e-5)
            if normalization == "LayerNorm"
            else F.rms_norm(x, (16,), base.layer_norm_weight, 1e-5))
    weight = base.weight + layer.lora_B["default"].weight @ layer.lora_A["default"].weight * 2
    want = F.linear(norm, weight, base.bias)
    assert torch.allclose(out, want, atol=1e-5)
    grad, = torch.autograd.grad(out.square().sum(), x)
    want_grad, = torch.autograd.grad(want.square().sum(), x)
    assert torch.allclose(grad, want_grad, atol=1e-4)


def test_lora_is_accepted_on_the_te_spec_and_refused_without_te():
    flags = dict(SHAPE, attention_backend="auto")
    config = resolve(RunArguments.from_flags(**flags, tuner_type="lora"), world_size=1,
                     cuda=True, transformer_engine=True)
    assert config.layer_spec == "transformer_engine"
    with pytest.raises(ArgumentError, match="--attention_backend transformer_engine needs"):
        resolve(RunArguments.from_flags(**dict(flags, attention_backend=
                                                    "transformer_engine"), tuner_type="lora"),
                world_size=1, cuda=True, transformer_engine=False)
    assert lora_te.linear_kinds() == {}  # without TE: megatron's classes are mocks


def test_expert_adapters_on_the_te_spec_under_tp_are_refused_by_name():
    """megatron's TE expert linears do not say they are an expert's, which decides how the
    adapter's factors split and communicate: refused at TP > 1 (not at EP, not without
    expert targets)."""
    moe = dict(SHAPE, attention_backend="auto", num_experts=4, moe_ffn_hidden_size=32,
               moe_grouped_gemm=False, moe_layer_freq="[0,1]", tuner_type="lora",
               lora_dropout=0.0)

    def build(**flags):
        world = flags.get("tensor_model_parallel_size", 1) * flags.get(
            "expert_model_parallel_size", 1)
        return resolve(RunArguments.from_flags(**moe, **flags), world_size=world, cuda=True,
                       transformer_engine=True)

    tp2 = dict(tensor_model_parallel_size=2, sequence_parallel=True)
    with pytest.raises(ArgumentError) as err:
        build(**tp2)
    assert str(err.value).startswith(
        "--tuner_type lora with adapters on routed experts (decoder.layers.1.mlp.experts."
        "local_experts.0.linear_fc1) on Transformer Engine's layer spec at "
        "--tensor_model_parallel_size 2: not supported yet")
    assert build(**tp2, target_modules="linear_qkv,linear_proj").layer_spec == \
        "transformer_engine"
    build(expert_model_parallel_size=2)


def test_a_target_of_a_class_without_lora_layer_is_refused(gloo_group, monkeypatch):
    """TE's spec where TE's classes are not recognised: refused, not left without adapters."""
    from swift_mcore.models import lora

    config = lora_config()
    model = te_model(config, monkeypatch)
    with pytest.raises(ArgumentError, match=r"--tuner_type lora: decoder\.layers\.0\."
                                            r"self_attention\.linear_\w+ is a StandIn\w+, "
                                            "which has no LoRA layer"):
        lora.apply(config, [model])


class _Patch:
    """monkeypatch.setattr in a spawned rank (which ends with its changes)."""

    @staticmethod
    def setattr(obj, name, value):
        setattr(obj, name, value)


def _tp2_rank(rank, port):
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state

    from swift_mcore.models import lora
    from swift_mcore.models.gpt import build_model
    from swift_mcore.runtime import seed
    from swift_mcore.runtime.cpu import cpu_compat

    cpu_compat.activate()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(2, 1)
    lora_te.linear_kinds = lambda: STAND_INS
    config = resolve(RunArguments.from_flags(
        **SHAPE, tuner_type="lora", lora_rank=4, lora_alpha=16, lora_dropout=0.0,
        tensor_model_parallel_size=2), world_size=2).complete(256, None)
    seed.set_seed(1)
    local = build_model(config)[0]
    te = te_model(config, _Patch)
    from swift_mcore.models.convert import canonical

    weights = local.state_dict()  # this rank's shards, the TE spec's sharding
    te.load_state_dict({k: weights[canonical(k)] for k in te.state_dict()})
    for model in (local, te):
        lora.apply(config, [model])
        randomize_b(model)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    logits, grads = loss_and_grads(te, tokens)
    want_logits, want_grads = loss_and_grads(local, tokens)
    # The factors' shapes follow the full sizes TE's shard sizes give (A's columns of a
    # row-parallel layer, B's rows of a column-parallel one), and A's values are drawn from
    # the full matrix: the local spec's TP=2 model, shard for shard.
    qkv, proj = (te.decoder.layers[0].self_attention.linear_qkv,
                 te.decoder.layers[0].self_attention.linear_proj)
    assert (qkv.in_features, qkv.out_features, proj.in_features) == (64, 128, 64)
    assert qkv.lora_B["default"].weight.shape == (64, 4)
    assert proj.lora_A["default"].weight.shape == (4, 32)
    assert (logits - want_logits).abs().max() < 1e-5
    for name, grad in want_grads.items():
        assert torch.allclose(grads[name], grad, rtol=1e-4, atol=1e-7), name
    dist.destroy_process_group()


@pytest.mark.slow
def test_lora_on_the_te_spec_at_tp2_equals_the_local_spec():
    """Two spawned ranks: TE-interface linears sharded over TP=2 with their adapters."""
    import torch.multiprocessing as mp

    from run_helpers import free_port

    mp.spawn(_tp2_rank, args=(free_port(),), nprocs=2, join=True)
