"""wrap_model: returns chunks in every case and builds the gradient buckets asked for."""

import math

import pytest
import torch

from swift_mcore.arguments import RunArguments
from swift_mcore.models.gpt import build_model
from swift_mcore.run_config import resolve
from swift_mcore.runtime.ddp import bucket_size_for, wrap_model

TINY = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
            seq_length=32, vocab_size=256, lr_warmup_iters=1, train_iters=2)



def num_grad_buckets(ddp_chunk) -> int:
    """How many gradient buckets megatron really built for one DDP chunk."""
    return sum(len(group.buckets) for group in ddp_chunk.bucket_groups)

def tiny_args(padded_vocab=256, **flags):
    """A complete RunConfig whose embedding has ``padded_vocab`` rows."""
    args = RunArguments.from_flags(**{**TINY, **flags})
    config = resolve(args, world_size=1, cuda=False)
    return config.complete(args.model.vocab_size, None, padded_vocab_size=padded_vocab)


def test_unwrapped_is_still_a_list(gloo_group):
    args = tiny_args()
    model = build_model(args)[0]
    chunks = wrap_model(args, model, wrap_with_ddp=False)
    assert chunks == [model]


def expected_buckets(params, bucket_size):
    """Megatron's rule, restated: walk parameters backwards (backprop order) and close a
    bucket once it holds at least bucket_size elements."""
    count, filled = 0, 0
    for p in reversed([p for p in params if p.requires_grad]):
        filled += p.numel()
        if filled >= bucket_size:
            count, filled = count + 1, 0
    return count + (1 if filled else 0)


@pytest.mark.parametrize("num_buckets", [1, 2, 3, 4, 5, 8])
def test_bucket_count_follows_num_buckets(gloo_group, num_buckets):
    args = tiny_args(num_buckets=num_buckets, overlap_grad_reduce=True, num_layers=8,
                     vocab_size=128, make_vocab_size_divisible_by=64, padded_vocab=128)
    models = build_model(args)
    params = list(models[0].parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    bucket_size = bucket_size_for(args, models)
    assert bucket_size == math.ceil(trainable / num_buckets)
    ddp = wrap_model(args, models)
    assert len(ddp) == 1
    built = num_grad_buckets(ddp[0])
    assert built == expected_buckets(params, bucket_size)
    if num_buckets <= 4:
        # parameters are small next to the buckets here: exactly the number asked for
        assert built == num_buckets
    else:
        # a bucket cannot split a parameter: never more than asked
        assert 1 <= built <= num_buckets


def test_bucket_size_wins_and_later_chunks_are_not_bucketed(gloo_group):
    args = tiny_args(bucket_size=5_000, overlap_grad_reduce=True, num_buckets=2)
    first, second = build_model(args)[0], build_model(args)[0]
    assert bucket_size_for(args, [first]) == 5_000
    ddp = wrap_model(args, [first, second])
    assert num_grad_buckets(ddp[0]) > 2
    assert num_grad_buckets(ddp[1]) == 1


def test_without_overlap_one_bucket(gloo_group):
    ddp = wrap_model(tiny_args(), build_model(tiny_args()))
    assert num_grad_buckets(ddp[0]) == 1


def _main_grads_after(args, fused: bool, micro_batches: int = 2):
    """main_grad of every trainable parameter after ``micro_batches`` forward-backward
    passes of one DDP-wrapped tiny model (the same initial weights each call)."""
    from swift_mcore.runtime import seed

    seed.set_seed(1234)
    (ddp,) = wrap_model(args, build_model(args))
    if not fused:
        for module in ddp.modules():
            if hasattr(module, "gradient_accumulation_fusion"):
                module.gradient_accumulation_fusion = False
    generator = torch.Generator().manual_seed(0)
    for _ in range(micro_batches):
        tokens = torch.randint(0, 256, (2, 32), generator=generator)
        position_ids = torch.arange(32).unsqueeze(0).expand(2, -1)
        losses = ddp(tokens, position_ids, None, labels=torch.roll(tokens, -1, 1))
        losses.float().sum().backward()
    grads = {name: p.main_grad.clone() for name, p in ddp.module.named_parameters()}
    stray = [name for name, p in ddp.module.named_parameters() if p.grad is not None]
    return grads, stray


@pytest.mark.parametrize("tied", [False, True])
def test_weight_gradients_accumulate_into_main_grad_as_the_unfused_path(gloo_group, tied,
                                                                       monkeypatch):
    """On CPU the DDP-wrapped linears add their weight gradients straight into main_grad
    (runtime/cpu/cpu_compat.py): over two micro-batches the gradients equal megatron's unfused
    path's (a weight-gradient tensor per linear that DDP's hook adds), with the output
    layer sharing the embedding's weight too (megatron zero-fills its placeholder there)."""
    from swift_mcore.runtime.cpu import cpu_compat
    from swift_mcore.runtime.cpu.cpu_compat import accumulate_weight_gradients_in_place

    stand_in = cpu_compat._WeightGradientAccumulation
    calls = []
    accumulate = stand_in.wgrad_gemm_accum_fp32
    monkeypatch.setattr(stand_in, "wgrad_gemm_accum_fp32",
                        lambda *tensors: (calls.append(1), accumulate(*tensors)))
    args = tiny_args(untie_embeddings_and_output_weights=not tied)
    (ddp,) = wrap_model(args, build_model(args))
    # qkv, proj, fc1, fc2 per layer, and the output layer (with the embedding's weight if tied)
    assert accumulate_weight_gradients_in_place(ddp) == 4 * 4 + 1
    fused, stray_fused = _main_grads_after(args, fused=True)
    assert len(calls) == 17 * 2  # every linear, both micro-batches
    unfused, stray_unfused = _main_grads_after(args, fused=False)
    assert len(calls) == 17 * 2
    assert stray_fused == stray_unfused == []  # DDP's hooks took every gradient
    assert fused.keys() == unfused.keys()
    for name in fused:
        assert fused[name].abs().sum() > 0, name
        torch.testing.assert_close(fused[name], unfused[name], rtol=1e-5, atol=1e-7,
                                   msg=name)


def test_a_bare_model_keeps_megatrons_unfused_weight_gradients(gloo_group):
    """Without DDP there is no main_grad for the fused path to add into: build_model's
    linears keep the flag off and backward fills param.grad as usual."""
    args = tiny_args()
    model = build_model(args)[0]
    assert not any(getattr(m, "gradient_accumulation_fusion", False) for m in model.modules())
    tokens = torch.randint(0, 256, (2, 32))
    model(tokens, torch.arange(32).unsqueeze(0).expand(2, -1), None,
          labels=tokens).float().sum().backward()
    assert all(p.grad is not None for p in model.parameters())
