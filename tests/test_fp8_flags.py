"""--fp8_format, --fp8_recipe and --fp8_param_gather: megatron's FP8 settings on a GPU with
Transformer Engine's spec (simulated here through resolve(cuda=True), as
tests/test_gpu_paths.py does), refused in one line naming the flag anywhere else."""

import dataclasses

import pytest

from swift_mcore.arguments import RunArguments
from swift_mcore.errors import ArgumentError
from swift_mcore.run_config import resolve

SMALL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, micro_batch_size=1,
             global_batch_size=2)


def gpu(transformer_engine=True, **flags):
    return resolve(RunArguments.from_flags(**SMALL, **flags), world_size=1, cuda=True,
                   transformer_engine=transformer_engine)


@pytest.mark.parametrize("flags,message", [
    ({"fp8_format": "e4m3"}, "--fp8_format e4m3 needs a CUDA GPU with Transformer Engine"),
    ({"fp8_recipe": "tensorwise"}, "--fp8_recipe needs --fp8_format"),
    ({"fp8_param_gather": True}, "--fp8_param_gather needs --fp8_format"),
])
def test_fp8_is_refused_on_cpu_naming_the_flag(flags, message):
    with pytest.raises(ArgumentError, match=message):
        resolve(RunArguments.from_flags(**SMALL, **flags), world_size=1, cuda=False)


def test_fp8_on_a_gpu_needs_transformer_engine_and_fp8_weights_the_distributed_optimizer():
    with pytest.raises(ArgumentError, match="--fp8_format hybrid needs Transformer Engine's "
                                            "layer spec"):
        gpu(transformer_engine=False, fp8_format="hybrid")
    with pytest.raises(ArgumentError, match="--fp8_param_gather needs "
                                            "--use_distributed_optimizer"):
        gpu(fp8_format="hybrid", fp8_param_gather=True)


def test_fp8_flags_reach_megatrons_configs(monkeypatch):
    from megatron.core.distributed import DistributedDataParallel

    from swift_mcore.models.gpt import transformer_config
    from swift_mcore.runtime import ddp

    config = gpu(fp8_format="hybrid", fp8_recipe="tensorwise", fp8_param_gather=True,
                 use_distributed_optimizer=True).complete(256, None)
    # (TE's fused RoPE is not importable here: the TransformerConfig would refuse it)
    tc = transformer_config(dataclasses.replace(config, rope_fusion=False))
    assert (tc.fp8, tc.fp8_recipe, tc.fp8_param) == ("hybrid", "tensorwise", True)
    assert "with FP8 hybrid (tensorwise)" in config.describe()  # the start-up line
    seen = {}
    monkeypatch.setattr(DistributedDataParallel, "__init__",
                        lambda self, config, ddp_config, module, disable_bucketing:
                        seen.update(ddp=ddp_config))
    monkeypatch.setattr(ddp.torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(ddp.torch.cuda, "current_stream", lambda: _Stream())
    monkeypatch.setattr(ddp.torch.cuda, "stream", lambda s: _Context())
    monkeypatch.setattr(ddp.cpu, "after_ddp", lambda chunks, config: 0)
    ddp.wrap_model(config, [_Chunk()])
    assert seen["ddp"].fp8_param_gather and seen["ddp"].use_distributed_optimizer
    plain = gpu(fp8_format="e4m3").complete(256, None)
    tc = transformer_config(dataclasses.replace(plain, rope_fusion=False))
    assert (tc.fp8, tc.fp8_recipe, tc.fp8_param) == ("e4m3", "delayed", False)
    off = transformer_config(dataclasses.replace(gpu().complete(256, None), rope_fusion=False))
    assert off.fp8 is None and not off.fp8_param


class _Stream:
    def wait_stream(self, other):
        pass


class _Context:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Chunk:
    config = None

    def parameters(self):
        return iter(())
