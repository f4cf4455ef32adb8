"""swift-mcore: pretraining and finetuning of GPT models on megatron-core, resumable exactly."""

from ._deferred_imports import defer_optional_imports

defer_optional_imports()  # before anything imports megatron-core

from .arguments import PretrainArguments, RunArguments, SftArguments  # noqa: E402

__version__ = "0.1.0"
__all__ = ["PretrainArguments", "RunArguments", "SftArguments", "Trainer", "__version__"]


def __getattr__(name):
    # The trainer (and megatron-core with it) is imported on first use, so that the CLI
    # can settle the environment megatron is imported under first (cli.main).
    if name == "Trainer":
        from .training.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'swift_mcore' has no attribute {name!r}")
