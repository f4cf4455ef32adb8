"""The CUDA paths, checked on CPU by simulating the GPU: collectives on the backend's device,
Transformer Engine's _extra_state in strict loads, the pinned GPU extras, the conversion
child, the flag checks and the GPU defaults (docs/gpu.md)."""

import datetime
import importlib.metadata
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from swift_mcore.arguments import PretrainArguments
from swift_mcore.errors import ArgumentError, CheckpointError
from swift_mcore.run_config import resolve

ROOT = Path(__file__).resolve().parents[1]
META = torch.device("meta")  # a device whose values the host cannot read: a sync raises


def gpu(world_size=1, transformer_engine=True, **flags):
    return resolve(PretrainArguments.from_flags(**flags), world_size=world_size, cuda=True,
                   transformer_engine=transformer_engine)


def cpu(world_size=1, **flags):
    return resolve(PretrainArguments.from_flags(**flags), world_size=world_size, cuda=False)


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
