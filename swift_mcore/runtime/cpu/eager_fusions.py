"""Without CUDA, megatron-core's torch.compile'd elementwise fusions run as plain functions.

megatron decorates them with torch.compile when its modules are imported. On CPU that
decoration alone imports inductor in every process (seconds of start-up, benchmarks/README.md)
for functions the CPU path runs eagerly anyway (the losses are bit-identical either way).
``eager_fusions_without_cuda`` must run before megatron is imported; the ranks a launcher
starts inherit its environment variable.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys


def eager_fusions_without_cuda(cuda: bool) -> None:
    """Without CUDA (``cuda`` False): TORCHDYNAMO_DISABLE=1 unless the environment sets it,
    and megatron's jit fuser switched off as megatron.core.jit is imported."""
    if "TORCHDYNAMO_DISABLE" not in os.environ and not cuda:
        os.environ["TORCHDYNAMO_DISABLE"] = "1"
    if (os.environ.get("TORCHDYNAMO_DISABLE") == "1" and "megatron.core.jit" not in sys.modules
            and not any(isinstance(f, _AfterJitModule) for f in sys.meta_path)):
        # Disabled, torch.compile hands each function back as it is, but the decoration
        # still imports torch._dynamo (its default backend's registry) in every process's
        # megatron import. megatron's own switch, disable_jit_fuser(), makes the
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
