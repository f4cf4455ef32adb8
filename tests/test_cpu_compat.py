"""Each CPU adaptation of megatron-core: the call that needed CUDA now works on CPU."""

import pytest
import torch

from swift_mcore.runtime.cpu import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only adaptation")


@pytest.fixture(autouse=True)
def active():
    assert cpu_compat.activate()


def test_every_listed_module_sees_the_cpu_torch():
    import importlib

    for name in cpu_compat.PATCHED_MODULES:
        module = importlib.import_module(name)
        assert isinstance(module.torch, cpu_compat._CpuTorch), name
        assert module.torch.cuda.current_device() == "cpu"


def test_factories_redirect_cuda_devices_only():
    proxy = cpu_compat._CpuTorch()
    assert proxy.zeros(2, device="cuda").device.type == "cpu"
    assert proxy.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
    assert proxy.empty(3, device=0).device.type == "cpu"
    assert proxy.ones(1, device="meta").device.type == "meta"  # other devices untouched
    assert proxy.nn is torch.nn and proxy.float32 is torch.float32
    # the real torch is untouched everywhere else
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")


def test_rope_embedding_stays_on_cpu():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0)
    emb = rope(8)
    assert emb.device.type == "cpu" and emb.shape == (8, 1, 1, 16)


def test_global_memory_buffer_allocates_on_cpu():
    from megatron.core.utils import GlobalMemoryBuffer

    buf = GlobalMemoryBuffer().get_tensor([4, 4], torch.float32, "x")
    assert buf.device.type == "cpu" and buf.shape == (4, 4)


def test_default_causal_mask_on_cpu():
    from megatron.core.transformer.utils import get_default_causal_mask

    mask = get_default_causal_mask(4)
    assert mask.device.type == "cpu"
    assert mask.tolist()[0] == [False, True, True, True]


def test_learnable_softmax_offset_is_created_on_cpu(gloo_group):
    """megatron's attention sinks (softmax_type 'learnable', gpt-oss) are a parameter made
    on the CUDA device in DotProductAttention's constructor."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                               use_cpu_initialization=True, softmax_type="learnable")
    attention = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                    attention_type="self")
    assert attention.softmax_offset.device.type == "cpu"
    assert attention.softmax_offset.shape == (4,)


def test_clip_grad_scales_like_megatron():
    from megatron.core.optimizer import optimizer

    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    total_norm = float(torch.sqrt(torch.tensor(5 * 4.0)))
    optimizer.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=total_norm)
    clipped = torch.cat([p.grad for p in params])
    assert torch.allclose(clipped.norm(), torch.tensor(1.0), atol=1e-5)
    optimizer.clip_grad_by_total_norm_fp32(params, max_norm=10.0, total_norm=1.0)
    assert torch.allclose(torch.cat([p.grad for p in params]), clipped)  # no-op below max


def test_grad_norm_and_fp32_optimizer_on_cpu(gloo_group):
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
    from megatron.core.optimizer.optimizer import FP32Optimizer
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    grads = [torch.full((3,), 2.0), torch.full((2,), 2.0)]
    assert get_grad_norm_fp32(grads) == pytest.approx(float(torch.tensor(20.0).sqrt()))
    param = torch.nn.Parameter(torch.ones(2))
    opt = FP32Optimizer(torch.optim.SGD([param], lr=0.1), OptimizerConfig(lr=0.1), None)
    assert opt.get_loss_scale().device.type == "cpu"


def test_untested_megatron_version_is_refused(monkeypatch):
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__version__", "0.99.0")
    monkeypatch.delenv("SWIFT_MCORE_ALLOW_UNTESTED_MCORE", raising=False)
    with pytest.raises(RuntimeError, match="tested with megatron-core 0.16.1, but 0.99.0"):
        cpu_compat.check_version()
    # the fixes every machine needs name themselves and the way to try anyway
    from swift_mcore.runtime.mcore_adaptation import require_tested_version

    with pytest.raises(RuntimeError, match=r"^swift-mcore's distributed-optimizer checkpoint "
                                           r"fix was tested with megatron-core 0.16.1, but "
                                           r"0.99.0 is installed. .*\(requirements/base.txt\), "
                                           r"or set SWIFT_MCORE_ALLOW_UNTESTED_MCORE=1 to try "
                                           r"anyway.$"):
        require_tested_version("distributed-optimizer checkpoint fix")
    monkeypatch.setenv("SWIFT_MCORE_ALLOW_UNTESTED_MCORE", "1")
    assert cpu_compat.check_version() == "0.99.0"


def test_recompute_rng_bookkeeping_on_cpu(gloo_group):
    """megatron's CheckpointFunction saves and restores every RNG state around the
    recomputed forward: on CPU the (absent) CUDA state is empty, its restore queues nothing,
    and the recomputed dropout draws the forward's mask."""
    import torch.cuda
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random

    cpu_state, cuda_state, tracker = random._get_all_rng_states()
    assert torch.equal(cpu_state, torch.get_rng_state()) and cuda_state.numel() == 0
    queued = len(torch.cuda._queued_calls)
    for _ in range(3):
        random._set_all_rng_states(cpu_state, cuda_state, tracker)
    assert len(torch.cuda._queued_calls) == queued  # nothing kept until CUDA starts (never)

    x = torch.randn(64, 64, requires_grad=True)

    def layer(t):
        return torch.nn.functional.dropout(t * 2.0, p=0.5, training=True)

    torch.manual_seed(3)
    layer(x).pow(2).sum().backward()
    plain, x.grad = x.grad.clone(), None
    torch.manual_seed(3)
    tensor_parallel.checkpoint(layer, False, x).pow(2).sum().backward()
    assert torch.equal(x.grad, plain)


def test_norm_recompute_needs_no_transformer_engine_on_cpu():
    """--recompute_modules layernorm: megatron's CheckpointWithoutOutput() takes its FP8 path
    (Transformer Engine) for its default fp8=False; without CUDA it is built without FP8."""
    from megatron.core import tensor_parallel

    checkpoint = tensor_parallel.CheckpointWithoutOutput()
    assert checkpoint.fp8 is False
    x = torch.randn(4, 8, requires_grad=True)
    norm = torch.nn.LayerNorm(8)
    out = checkpoint.checkpoint(norm, x)
    y = out * 3.0
    checkpoint.discard_output_and_register_recompute(y)
    y.sum().backward()
    expected = torch.autograd.grad((norm(x) * 3.0).sum(), x)[0]
    assert torch.allclose(x.grad, expected, atol=1e-6)


def _uneven_collectives(rank, port, folder):
    """One of two gloo ranks: megatron's gather/reduce-scatter along the first dimension
    with a different number of rows per rank (the MoE dispatchers' routed tokens). Writes
    what it got as lists to ``folder/rank.json`` (plain values in a file: nothing the parent
    reads depends on this process still being alive)."""
    import json
    import os

    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    cpu_compat.activate()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    group = dist.new_group([0, 1])
    sizes = [2, 3]
    mine = torch.arange(sizes[rank] * 2, dtype=torch.float32).reshape(-1, 2) + 10 * rank
    gathered = mappings._gather_along_first_dim(mine, group, output_split_sizes=sizes)
    full = torch.arange(10, dtype=torch.float32).reshape(5, 2) * (rank + 1)
    scattered = mappings._reduce_scatter_along_first_dim(full, group, input_split_sizes=sizes)
    part = os.path.join(folder, f"{rank}.part")
    with open(part, "w") as fh:
        json.dump({"gathered": gathered.tolist(), "scattered": scattered.tolist()}, fh)
    os.replace(part, os.path.join(folder, f"{rank}.json"))  # whole or absent
    dist.destroy_process_group()


def test_uneven_gather_and_reduce_scatter_on_gloo(tmp_path):
    """gloo refuses pieces of different sizes ('ProcessGroupGloo::allgather: invalid tensor
    size'); the adaptation pads, exchanges and cuts back."""
    import json

    import torch.multiprocessing as mp

    from run_helpers import free_port

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_uneven_collectives, args=(rank, port, str(tmp_path)))
             for rank in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    got = {rank: json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)}
    expected = torch.cat([torch.arange(4.0).reshape(2, 2), torch.arange(6.0).reshape(3, 2) + 10])
    full_sum = torch.arange(10.0).reshape(5, 2) * 3  # rank 0's tensor plus rank 1's (x2)
    for rank in (0, 1):
        assert got[rank]["gathered"] == expected.tolist()
    assert got[0]["scattered"] == full_sum[:2].tolist()
    assert got[1]["scattered"] == full_sum[2:].tolist()


def test_eager_rope_equals_megatrons_unfused_rope_bit_for_bit():
    from megatron.core.models.common.embeddings import rope_utils

    from swift_mcore.runtime.cpu.eager_rope import make_apply_rotary_bshd

    original = getattr(rope_utils._apply_rotary_pos_emb_bshd, "_swift_mcore_original",
                       rope_utils._apply_rotary_pos_emb_bshd)
    ours = make_apply_rotary_bshd(original)
    g = torch.Generator().manual_seed(3)
    for dtype, mscale, rot in ((torch.float32, 1.0, 16), (torch.bfloat16, 0.7, 16),
                               (torch.float32, 1.0, 8)):  # rot 8 of 16: megatron's own path
        t = torch.randn(12, 2, 3, 16, generator=g).to(dtype)
        inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
        f = torch.outer(torch.arange(12).float(), inv)
        freqs = torch.cat((f, f), -1)[:, None, None, :]
        grad = torch.randn(12, 2, 3, 16, generator=g).to(dtype)
        a, b = t.clone().requires_grad_(), t.clone().requires_grad_()
        out_a, out_b = original(a, freqs, mscale=mscale), ours(b, freqs, mscale=mscale)
        out_a.backward(grad)
        out_b.backward(grad)
        assert torch.equal(out_a, out_b) and torch.equal(a.grad, b.grad)


def test_activate_installs_the_eager_rope():
    from megatron.core.models.common.embeddings import rope_utils

    cpu_compat.activate()
    assert hasattr(rope_utils._apply_rotary_pos_emb_bshd, "_swift_mcore_original")


def test_eager_rope_takes_cos_and_sin_once_per_freqs_tensor(monkeypatch):
    """megatron hands every layer the same (lru-cached) freqs tensor: cos and sin are taken
    once for it, again when it changes in place, and for each freqs tensor of its own."""
    from swift_mcore.runtime.cpu import eager_rope

    calls = []
    real_cos = torch.cos
    monkeypatch.setattr(eager_rope.torch, "cos", lambda x: calls.append(x) or real_cos(x))
    apply = eager_rope.make_apply_rotary_bshd(lambda *a, **k: pytest.fail("fast path"))
    freqs = torch.outer(torch.arange(6).float(), torch.rand(4)).repeat(1, 2)[:, None, None, :]
    t = torch.randn(6, 2, 3, 8)
    first = apply(t, freqs)
    assert torch.equal(apply(t, freqs), first) and len(calls) == 1
    freqs.mul_(2.0)  # the version counter moves: a fresh cos and sin, and a new result
    assert not torch.equal(apply(t, freqs), first) and len(calls) == 2
    apply(t, freqs.clone())
    apply(t, freqs, mscale=0.5)
    assert len(calls) == 4
    with torch.inference_mode():
        apply(t, freqs)
    assert len(calls) == 5


def _megatron_cross_entropy():
    from megatron.core import tensor_parallel

    ours = tensor_parallel.vocab_parallel_cross_entropy
    return ours, getattr(ours, "_swift_mcore_original", ours)


@pytest.mark.parametrize("vocab", [4096, 151936])
def test_eager_cross_entropy_equals_megatrons(gloo_group, vocab):
    ours, original = _megatron_cross_entropy()
    assert ours is not original  # activate() installed it
    g = torch.Generator().manual_seed(5)
    tokens = 64 if vocab > 10000 else 256
    logits = torch.randn(tokens, 2, vocab, generator=g) * 4
    target = torch.randint(0, vocab, (tokens, 2), generator=g)
    grad = torch.rand(tokens, 2, generator=g)
    results = []
    for fn in (original, ours):
        x = logits.clone().requires_grad_()
        loss = fn(x * 1.0, target)  # both overwrite their input: give them a fresh one
        loss.backward(grad)
        results.append((loss.detach(), x.grad))
    # Against float64: megatron's loss is within 2e-6 of it, ours (torch's log_softmax
    # accumulation, as in F.cross_entropy) within 3e-5 at 151,936 columns.
    reference = logits.double()
    expected_loss = -torch.log_softmax(reference, -1).gather(-1, target[..., None])[..., 0]
    softmax = torch.softmax(reference, -1)
    softmax.scatter_add_(-1, target[..., None], -torch.ones(tokens, 2, 1, dtype=torch.double))
    expected_grad = softmax * grad[..., None].double()
    for loss, x_grad in results:
        assert torch.allclose(loss.double(), expected_loss, rtol=1e-5, atol=1e-6)
        assert torch.allclose(x_grad.double(), expected_grad, rtol=1e-4, atol=1e-10)
    (loss_a, grad_a), (loss_b, grad_b) = results
    assert torch.allclose(loss_b, loss_a, rtol=1e-5) and torch.allclose(grad_b, grad_a, rtol=1e-4)


def test_eager_cross_entropy_hands_other_cases_to_megatron(gloo_group, monkeypatch):
    from swift_mcore.runtime.cpu import eager_cross_entropy

    seen = []
    ours = eager_cross_entropy.make_cross_entropy(lambda *args: seen.append(args) or "megatron")
    logits, target = torch.randn(4, 2, 10), torch.randint(0, 10, (4, 2))
    assert torch.is_tensor(ours(logits.clone(), target)) and not seen
    assert ours(logits.clone(), target, 0.1) == "megatron"  # label smoothing
    assert ours(logits.clone(), torch.where(target > 4, -100, target)) == "megatron"
    assert ours(logits.clone(), torch.full_like(target, 10)) == "megatron"  # out of vocab
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 2)
    assert ours(logits.clone(), target) == "megatron"
    assert len(seen) == 4
