"""Optional packages megatron-core imports with itself but a run rarely uses, loaded on first use."""

import importlib
import importlib.util
import sys
import types

# megatron-core imports wandb when it is imported (megatron/core/timers.py and
# inference/contexts/dynamic_context.py, each in a try/except) and only binds the name;
# wandb, with its pydantic, click and protobuf, is a large share of a CPU process's start-up,
# for a package that only --report_to wandb (training/trackers.py) uses.
DEFERRED = ("wandb",)


class DeferredModule(types.ModuleType):
    """Stands in sys.modules for a package until one of its attributes is asked for; then
    the package is imported for real, replaces the stand-in there, and answers.

    The stand-in carries the real spec and __file__ (inspect.getmodule, called by torch at
    import, asks every module for __file__; importlib.util.find_spec reads __spec__), but
    no __path__: importing a submodule first loads the package itself."""

    def __getattr__(self, attr):  # only reached for what the stand-in does not carry
        name = self.__name__
        if sys.modules.get(name) is self:
            del sys.modules[name]
        return getattr(importlib.import_module(name), attr)


def defer_optional_imports() -> None:
    """Put a DeferredModule in sys.modules for each of DEFERRED that is installed and not yet
    imported (one that is not installed is left missing: megatron's own `except ImportError`
    still decides without it)."""
    for name in DEFERRED:
        if name in sys.modules:
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        stand_in = DeferredModule(name)
        stand_in.__spec__ = spec
        stand_in.__loader__ = spec.loader
        stand_in.__file__ = spec.origin
        sys.modules[name] = stand_in
