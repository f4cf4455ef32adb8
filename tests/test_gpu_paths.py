"""The CUDA paths, checked on CPU by simulating the GPU: collectives on the backend's device,
Transformer Engine's _extra_state in strict loads, the pinned GPU extras, the conversion
child, the flag checks and the GPU defaults (docs/gpu.md)."""

import importlib.metadata
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from swift_mcore.arguments import RunArguments
from swift_mcore.errors import ArgumentError, CheckpointError
from swift_mcore.run_config import resolve

ROOT = Path(__file__).resolve().parents[1]
META = torch.device("meta")  # a device whose values the host cannot read: a sync raises


def gpu(world_size=1, transformer_engine=True, **flags):
    return resolve(RunArguments.from_flags(**flags), world_size=world_size, cuda=True,
                   transformer_engine=transformer_engine)


def cpu(world_size=1, **flags):
    return resolve(RunArguments.from_flags(**flags), world_size=world_size, cuda=False)


# ---- 1. every collective's tensor lives on the backend's device -------------------------
class Reached(Exception):
    pass


def test_tensor_collectives_run_on_the_backend_device(gloo_group, monkeypatch):
    from swift_mcore.runtime import collectives
    from swift_mcore.training import nonfinite
    from swift_mcore.training.trainer import Trainer

    seen = []

    def all_reduce(tensor, *args, **kwargs):
        seen.append(tensor.device)
        raise Reached  # the value cannot be read on meta; reaching the call is the point

    monkeypatch.setattr(collectives, "backend_device", lambda group=None: META, raising=False)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    trainer = Trainer(cpu())
    calls = {"count_all_parameters": lambda: trainer.count_all_parameters(10),
             "exit_reason": trainer.exit_reason,
             "reduce_losses": lambda: trainer.reduce_losses([{"lm loss": torch.ones(3)}]),
             "nonfinite.agree": lambda: nonfinite.agree(1.0, 2.0)}
    for name, call in calls.items():
        with pytest.raises(Reached):
            call()
        assert seen.pop() == META, name


def test_the_backend_device_is_the_ranks_gpu_under_nccl(gloo_group, monkeypatch):
    from swift_mcore.runtime import collectives

    assert collectives.backend_device() == torch.device("cpu")  # gloo
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collectives.backend_device() == torch.device("cuda", 3)


def test_no_tensor_collective_bypasses_the_backend_device():
    pattern = re.compile(r"dist\.(all_reduce|reduce|broadcast|all_gather|all_gather_into_tensor|"
                         r"reduce_scatter|reduce_scatter_tensor|all_to_all)\(")
    offenders = [f"{path.relative_to(ROOT)}:{n}"
                 for path in (ROOT / "swift_mcore").rglob("*.py")
                 if path.name != "collectives.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if pattern.search(line)]
    assert not offenders, f"tensor collectives outside runtime/collectives.py: {offenders}"


# ---- 2. strict loads accept exactly the missing _extra_state keys -------------------------
class _WithExtraState(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.received = None

    def get_extra_state(self):
        return torch.tensor([5], dtype=torch.uint8)

    def set_extra_state(self, state):
        self.received = state


class _Stub(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.core = _WithExtraState()
        self.out = torch.nn.Linear(2, 1)


def test_restore_model_tolerates_only_missing_extra_state():
    from swift_mcore.checkpointing import io

    saved = _Stub().state_dict()
    assert "core._extra_state" in saved
    without_extra = {k: v for k, v in saved.items() if not k.endswith("_extra_state")}
    target = _Stub()
    io.restore_model([target], {"model": without_extra})
    assert torch.equal(target.out.weight, saved["out.weight"])
    assert target.core.received is None  # fresh extra state

    io.restore_model([target], {"model": saved})  # a present one still arrives
    assert torch.equal(target.core.received, torch.tensor([5], dtype=torch.uint8))

    missing = {k: v for k, v in saved.items() if k != "out.weight"}
    with pytest.raises(CheckpointError, match=r"missing out\.weight"):
        io.restore_model([_Stub()], {"model": missing})
    with pytest.raises(CheckpointError, match=r"unexpected stray\.weight"):
        io.restore_model([_Stub()], {"model": {**saved, "stray.weight": torch.zeros(1)}})


# ---- 3. checkpoints between models with and without TE's norm extra state ----------------
def _norms(chunk):
    yield chunk.decoder, "final_layernorm"
    for layer in chunk.decoder.layers:
        yield layer.self_attention, "q_layernorm"
        yield layer.self_attention, "k_layernorm"


def with_norm_extra_state(chunk, value):
    """As with Transformer Engine installed: the final and q/k norms carry an _extra_state."""
    for owner, name in _norms(chunk):
        norm = getattr(owner, name)
        norm.__class__ = type("TENormLike", (type(norm),), {
            "get_extra_state": lambda self: value.clone(),
            "set_extra_state": lambda self, state: setattr(self, "received", state)})
    return chunk


def _tiny(tmp_path, name):
    from swift_mcore.models.gpt import build_model
    from swift_mcore.runtime import seed

    config = cpu(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                 seq_length=32, vocab_size=256, qk_layernorm=True, no_save_optim=True,
                 output_dir=str(tmp_path / name)).complete(256, None)
    seed.set_seed(config.training.seed)
    return config, build_model(config)[0]


def _save(config, chunk):
    from swift_mcore.checkpointing import TrainState, save_checkpoint

    return save_checkpoint(config, TrainState(), [chunk], None, None, None)[0]


def _same_weights(a, b):
    sa = {k: v for k, v in a.state_dict().items() if not k.endswith("_extra_state")}
    sb = {k: v for k, v in b.state_dict().items() if not k.endswith("_extra_state")}
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_checkpoints_load_across_norms_with_and_without_extra_state(gloo_group, tmp_path):
    from swift_mcore.checkpointing import load_weights

    state = torch.tensor([1, 2, 3], dtype=torch.uint8)
    # CPU (local spec, no extra state) -> a model whose norms are TE's: the export --to_mcore
    # on CPU, then pt --load --finetune on GPU path.
    config, plain = _tiny(tmp_path, "cpu")
    folder = _save(config, plain)
    _, te_like = _tiny(tmp_path, "gpu")
    te_like = with_norm_extra_state(te_like, state)
    load_weights(folder, [te_like])
    assert _same_weights(plain, te_like)
    assert not hasattr(te_like.decoder.final_layernorm, "received")  # stays fresh

    # ... and the reverse: saved with the extra state, loaded into the local spec.
    config, source = _tiny(tmp_path, "gpu-saved")
    torch.nn.init.normal_(source.decoder.final_layernorm.weight)
    folder = _save(config, with_norm_extra_state(source, state))
    _, target = _tiny(tmp_path, "cpu-loaded")
    load_weights(folder, [target])
    assert _same_weights(source, target)

    # Extra state that is in the checkpoint is restored, not dropped.
    _, again = _tiny(tmp_path, "gpu-again")
    load_weights(folder, [with_norm_extra_state(again, torch.zeros(1, dtype=torch.uint8))])
    assert torch.equal(again.decoder.final_layernorm.received, state)


def test_local_spec_final_norm_is_never_transformer_engines(gloo_group, monkeypatch):
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from swift_mcore.models.gpt import block_spec, layer_spec, transformer_config

    class TENorm:  # what megatron's block takes for the final norm when TE is importable
        pass

    monkeypatch.setattr(transformer_block, "LayerNormImpl", TENorm)
    config = cpu(attention_backend="sdpa", num_layers=2).complete(256, None)
    tc = transformer_config(config)
    assert transformer_block._get_block_submodules(tc, layer_spec(config)).layer_norm is TENorm
    spec = block_spec(config, tc)
    assert spec.layer_norm is WrappedTorchNorm and len(spec.layer_specs) == 2


# ---- 4. the GPU extras: pinned as megatron-core asks; TE decided as megatron does ---------
def test_transformer_engine_is_pinned_to_megatron_cores_range():
    from packaging.requirements import Requirement

    ours = [Requirement(line) for line in (ROOT / "requirements/gpu.txt").read_text().splitlines()
            if line.startswith("transformer-engine")]
    assert len(ours) == 1 and "pytorch" in ours[0].extras
    extra = re.search(r'^gpu = \["([^"]+)"\]', (ROOT / "pyproject.toml").read_text(), re.M)
    assert Requirement(extra.group(1)) == ours[0]
    mcore = next(Requirement(r) for r in importlib.metadata.requires("megatron-core")
                 if r.startswith("transformer-engine"))
    for version in ("2.8.0", "2.9.0", "2.10.1", "2.11.0", "2.12.0", "3.0.0"):
        assert ours[0].specifier.contains(version) == mcore.specifier.contains(
            version, prereleases=False), version
    assert "--no-build-isolation" in (ROOT / "requirements/gpu.txt").read_text()
    assert "--no-build-isolation" in (ROOT / "docs/gpu.md").read_text()


def test_transformer_engine_counts_only_with_its_pytorch_layers(monkeypatch):
    from swift_mcore.runtime import hardware

    monkeypatch.setattr(hardware, "cuda_available", lambda: True)
    bare = types.ModuleType("transformer_engine")
    bare.__path__ = []  # a package without transformer_engine.pytorch
    monkeypatch.setitem(sys.modules, "transformer_engine", bare)
    monkeypatch.delitem(sys.modules, "transformer_engine.pytorch", raising=False)
    hardware.transformer_engine_available.cache_clear()
    try:
        assert not hardware.transformer_engine_available()
        hardware.transformer_engine_available.cache_clear()
        monkeypatch.setitem(sys.modules, "transformer_engine.pytorch",
                            types.ModuleType("transformer_engine.pytorch"))
        assert hardware.transformer_engine_available()
    finally:
        hardware.transformer_engine_available.cache_clear()


# ---- 5. the end-of-training conversion child: on the CPU, bounded -----------------------
def test_export_child_runs_on_the_cpu_and_is_bounded(monkeypatch):
    from swift_mcore.runtime import export_child as launch
    from swift_mcore.runtime.distributed import TIMEOUT

    calls = []

    def run(cmd, **kwargs):
        calls.append((cmd, kwargs))
        return subprocess.CompletedProcess(cmd, 0, stdout="wrote out\n", stderr="")

    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(launch.subprocess, "run", run)
    assert launch.export_in_subprocess("ckpt", "out", dtype="bfloat16") == "wrote out"
    cmd, kwargs = calls.pop()
    assert kwargs["env"]["CUDA_VISIBLE_DEVICES"] == "" and "LOCAL_RANK" not in kwargs["env"]
    assert 0 < kwargs["timeout"] < TIMEOUT.total_seconds()
    assert cmd[-2:] == ["--dtype", "bfloat16"]

    def too_slow(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    monkeypatch.setattr(launch.subprocess, "run", too_slow)
    with pytest.raises(RuntimeError, match=r"swift-mcore export --to_hf --model ckpt .*did not finish"):
        launch.export_in_subprocess("ckpt", "out")


# ---- 6. flag checks as on CUDA -------------------------------------------------------------
def test_gloo_with_cuda_is_refused():
    with pytest.raises(ArgumentError, match="--distributed_backend gloo with CUDA"):
        gpu(distributed_backend="gloo")
    assert cpu(distributed_backend="gloo").backend == "gloo"


def test_sequence_parallel_needs_norms_that_support_it():
    sp = dict(sequence_parallel=True, tensor_model_parallel_size=2, global_batch_size=16)
    with pytest.raises(ArgumentError, match="--sequence_parallel needs Transformer Engine"):
        gpu(world_size=2, transformer_engine=False, **sp)
    with pytest.raises(ArgumentError, match="--sequence_parallel needs Transformer Engine"):
        gpu(world_size=2, attention_backend="sdpa", **sp)  # TE there, but the local spec
    assert gpu(world_size=2, **sp).layer_spec == "transformer_engine"
    with_apex = resolve(RunArguments.from_flags(normalization="LayerNorm", **sp),
                        world_size=2, cuda=True, transformer_engine=False, apex=True)
    assert with_apex.parallel.sequence_parallel


def test_every_cuda_rank_sets_its_device(monkeypatch):
    import os

    from megatron.core import parallel_state

    from swift_mcore.runtime import distributed

    devices = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: None)
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    saved = os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    try:
        distributed.initialize(gpu(world_size=4, tensor_model_parallel_size=2))
        assert devices == [3]
        assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    finally:
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        if saved is not None:
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = saved


# ---- 7. GPU defaults as Megatron-LM's; the CPU path unchanged ------------------------------
def test_gpu_defaults_and_the_cpu_path(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    g = gpu(world_size=4, tensor_model_parallel_size=2)
    assert (g.precision, g.training.bf16, g.training.precision) == ("bf16", True, "bf16")
    assert not g.cpu_initialization and g.rope_fusion and g.fully_parallel_save
    assert g.environment == (("CUDA_DEVICE_MAX_CONNECTIONS", "1"),)
    line = g.describe()
    for text in ("bf16 (--precision auto)", "weights initialised on the GPU", "RoPE fusion on",
                 "fully parallel checkpoint save on", "CUDA_DEVICE_MAX_CONNECTIONS=1"):
        assert text in line
    assert gpu(transformer_engine=False).rope_fusion is False  # fused RoPE is TE's
    assert gpu(position_embedding_type="learned_absolute").rope_fusion is False

    c = cpu(world_size=4, tensor_model_parallel_size=2)
    assert (c.precision, c.training.bf16, c.training.fp16) == ("fp32", False, False)
    assert c.cpu_initialization and not c.rope_fusion and not c.fully_parallel_save
    assert c.environment == () and "on CPU" in c.describe()


def test_precision_is_overridable():
    assert gpu(precision="fp32").precision == "fp32"
    assert gpu(precision="fp32").training.bf16 is False
    assert gpu(fp16=True).precision == "fp16" and gpu(bf16=True).describe().count("auto") == 0
    with pytest.raises(ArgumentError, match="--bf16 and --precision fp32 disagree"):
        gpu(bf16=True, precision="fp32")
    with pytest.raises(ArgumentError, match="--precision bf16 needs a CUDA GPU"):
        cpu(precision="bf16")
    with pytest.raises(ArgumentError, match="--bf16 needs a CUDA GPU"):
        cpu(bf16=True)


def test_transformer_config_takes_the_gpu_defaults(monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils

    from swift_mcore.models.gpt import transformer_config

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)
    g = transformer_config(gpu(attention_backend="local").complete(256, None))
    assert (g.params_dtype, g.bf16, g.use_cpu_initialization, g.apply_rope_fusion) == (
        torch.bfloat16, True, False, True)
    c = transformer_config(cpu().complete(256, None))
    assert (c.params_dtype, c.bf16, c.use_cpu_initialization, c.apply_rope_fusion) == (
        torch.float32, False, True, False)


def test_packed_rows_reach_the_gpu_without_a_host_sync(monkeypatch):
    from swift_mcore.training.trainer import Trainer

    monkeypatch.setattr(Trainer, "device", lambda self: META, raising=False)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self.to(META))
    batch = {"tokens": torch.zeros(1, 6, dtype=torch.long),
             "segment_ids": torch.tensor([[0, 0, 1, 1, 1, 2]]),
             "sample_ids": torch.tensor([0])}
    for te, key in ((True, "packed_seq_params"), (False, "attention_mask")):
        trainer = Trainer(gpu(transformer_engine=te, micro_batch_size=1))
        trainer.model = [torch.nn.Linear(1, 1)]
        out = trainer.get_batch(iter([dict(batch)]))
        assert out["tokens"].device == META and key in out
        if te:  # THD: the lengths are host numbers, taken from the loader's CPU copy
            packed = out["packed_seq_params"]
            assert packed.cu_seqlens_q.device == META and packed.max_seqlen_q == 3


def test_fully_parallel_save_wraps_megatrons_strategy(gloo_group, monkeypatch):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    from swift_mcore.checkpointing import io

    strategies = []
    monkeypatch.setattr(dist_checkpointing, "save",
                        lambda state, folder, sharded_strategy=None: strategies.append(
                            sharded_strategy))
    io.save({}, "unused", fully_parallel=True)
    io.save({}, "unused")
    assert isinstance(strategies[0], FullyParallelSaveStrategyWrapper)
    assert strategies[1] is None  # the CPU path: megatron's default, as before


def test_each_rank_saves_and_restores_its_own_gpus_rng(monkeypatch):
    from swift_mcore.checkpointing import rng

    states = {d: torch.full((16,), d, dtype=torch.uint8) for d in range(8)}
    restored = []

    def get_all():
        raise AssertionError("every device's state: the other GPUs are other ranks'")

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_rng_state",
                        lambda device="cuda": states[device].clone())
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", get_all)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", get_all)
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda state, device="cuda": restored.append((device, state[0].item())))
    captured = rng.capture(gpu().cuda)  # RunConfig.cuda decides, not torch
    # restored on a node where this rank's GPU has another index
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert "cuda" in rng.apply(captured, gpu().cuda)
    assert restored.pop() == (1, 3)  # GPU 3's state onto this rank's GPU 1, not GPU 0's


# ---- 8. RunConfig.cuda reaches every module that branches on CUDA -------------------------
def _tiny_complete(**flags):
    return cpu(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
               seq_length=32, **flags).complete(256, None, padded_vocab_size=256)


def test_the_cpu_port_does_nothing_on_cuda(monkeypatch):
    """Each call of the CPU port's face is a no-op for a CUDA config and reaches its CPU
    piece for a CPU one."""
    from swift_mcore.runtime import cpu as port
    from swift_mcore.runtime.cpu import cpu_compat, fused_adamw, gloo_device, onednn_linear

    calls = []

    def spy(name, result=None):
        return lambda *args, **kwargs: calls.append(name) or result

    monkeypatch.setattr(cpu_compat, "activate", spy("activate", True))
    monkeypatch.setattr(onednn_linear, "enable", spy("enable"))
    monkeypatch.setattr(gloo_device, "install", spy("gloo_device"))
    monkeypatch.setattr(cpu_compat, "accumulate_weight_gradients_in_place", spy("wgrad", 4))
    from swift_mcore.runtime.cpu import local_dispatch

    monkeypatch.setattr(local_dispatch, "use_local_dispatch", spy("dispatch"))
    monkeypatch.setattr(fused_adamw, "use_fused_adamw", spy("adamw", 2))
    step = lambda: None  # noqa: E731

    g = gpu(trim_host_memory=True, cpu_matmul="onednn")
    assert (g.cpu_matmul, g.trim_host_memory) == (None, False)
    assert port.install(g) is False
    assert port.after_ddp(["chunk"], g) == 0 and port.after_optimizer(object(), g) == 0
    assert port.wrap_forward_step(step, g) is step
    assert calls == []

    c = cpu(trim_host_memory=True)
    assert port.install(c) is True and calls[:2] == ["activate", "enable"]
    assert port.after_ddp(["chunk", "chunk"], c) == 8 and port.after_optimizer(object(), c) == 2
    assert (port.wrap_forward_step(step, c) is not step) is c.trim_host_memory
    assert {"wgrad", "dispatch", "adamw"} <= set(calls)


def test_ddp_takes_its_gpu_path_from_the_config(gloo_group, monkeypatch):
    """cuda=True: DDP is built on a side stream and the linears keep megatron's unfused
    weight gradients (apex's kernel is the GPU's); cuda=False: no stream, the CPU port's
    in-place accumulation."""
    import contextlib
    import dataclasses

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from swift_mcore.models.gpt import build_model
    from swift_mcore.runtime.ddp import wrap_model

    streams = []

    class Stream:
        def __init__(self, *args, **kwargs):
            streams.append(self)

        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args, **kwargs: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    config = _tiny_complete()

    def fused(run_config):
        (chunk,) = wrap_model(run_config, build_model(config))
        return {m.gradient_accumulation_fusion for m in chunk.modules()
                if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}

    assert fused(dataclasses.replace(config, cuda=True)) == {False} and streams
    streams.clear()
    assert fused(config) == {True} and streams == []


def test_seeding_and_the_loader_take_cuda_from_the_config(gloo_group, monkeypatch):
    import dataclasses

    from megatron.core import tensor_parallel

    from swift_mcore.data import loader
    from swift_mcore.runtime import seed

    trackers = []
    monkeypatch.setattr(tensor_parallel, "model_parallel_cuda_manual_seed",
                        lambda s, **kwargs: trackers.append(kwargs["inference_rng_tracker"]))
    seed.set_seed(1, cuda=True)
    seed.set_seed(1, cuda=False)
    assert trackers == [False, True]  # the CUDA tracker forks a GPU generator; CPU: none

    pinned = []

    def data_loader(*args, **kwargs):
        pinned.append(kwargs["pin_memory"])
        raise Reached

    monkeypatch.setattr(torch.utils.data, "DataLoader", data_loader)
    config = _tiny_complete()
    for run_config in (dataclasses.replace(config, cuda=True), config):
        with pytest.raises(Reached):
            loader.build_data_iterator(list(range(64)), 0, run_config)
    assert pinned == [True, False]
