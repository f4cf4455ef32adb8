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
