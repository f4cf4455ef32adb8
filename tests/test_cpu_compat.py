"""Each CPU adaptation of megatron-core: the call that needed CUDA now works on CPU."""

import pytest
import torch

from swift_mcore.runtime import cpu_compat

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
    monkeypatch.setenv("SWIFT_MCORE_ALLOW_UNTESTED_MCORE", "1")
    assert cpu_compat.check_version() == "0.99.0"
