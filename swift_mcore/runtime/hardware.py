"""What this machine offers the run: CUDA, Transformer Engine, apex (asked once, by run_config)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from functools import lru_cache


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@lru_cache(maxsize=None)
def transformer_engine_available() -> bool:
    """Transformer Engine's PyTorch layers are importable, as megatron-core decides it
    (its HAVE_TE needs ``transformer_engine.pytorch``, not the bare package), and CUDA is
    there to run them."""
    return _usable_with_cuda("transformer_engine.pytorch")


@lru_cache(maxsize=None)
def apex_available() -> bool:
    """apex is importable, as megatron-core decides it (its HAVE_APEX, gpt_layer_specs.py):
    then the local spec's LayerNorm is apex's FusedLayerNorm, which supports sequence
    parallelism."""
    return _usable_with_cuda("apex", "megatron.core.fusions.fused_layer_norm")


def _usable_with_cuda(*modules: str) -> bool:
    """CUDA is there and every one of ``modules`` imports (any error: not usable)."""
    if not cuda_available():
        return False
    import importlib

    try:
        for name in modules:
            importlib.import_module(name)
    except Exception:
        return False
    return True


def eager_fusions_without_cuda() -> None:
    """Without CUDA, megatron-core's torch.compile'd elementwise fusions become plain
    functions: TORCHDYNAMO_DISABLE=1 unless the environment sets it. megatron decorates them
    with torch.compile when its modules are imported, and on CPU that decoration alone costs
    every process about 2 s (inductor's import) for functions the CPU path runs eagerly
    anyway (the losses are bit-identical either way). Must run before megatron is imported;
    the ranks a launcher starts inherit it."""
    if "TORCHDYNAMO_DISABLE" not in os.environ and not cuda_available():
        os.environ["TORCHDYNAMO_DISABLE"] = "1"
    if (os.environ.get("TORCHDYNAMO_DISABLE") == "1" and "megatron.core.jit" not in sys.modules
            and not any(isinstance(f, _AfterJitModule) for f in sys.meta_path)):
        # Disabled, torch.compile hands each function back as it is, but the decoration
        # still imports torch._dynamo (its default backend's registry): about 1 s of every
        # process's megatron import. megatron's own switch, disable_jit_fuser(), makes the
        # decorator a no-op; it must run once megatron/core/jit.py has executed and before
        # the fusion modules decorate with it, both inside `import megatron.core`.
        sys.meta_path.insert(0, _AfterJitModule())


class _AfterJitModule(importlib.abc.MetaPathFinder):
    """Finds megatron.core.jit the normal way, once, and has its loader call the module's
    disable_jit_fuser() right after executing it."""

    def find_spec(self, name, path, target=None):
        if name != "megatron.core.jit":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _DisableJitFuserLoader(spec.loader)
        return spec


class _DisableJitFuserLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        module.disable_jit_fuser()

    def __getattr__(self, attr):  # get_source, get_code ... (linecache, inspect)
        return getattr(self._loader, attr)
