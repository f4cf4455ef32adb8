"""swift-mcore: pretraining and finetuning of GPT models on megatron-core, resumable exactly."""

from .arguments import PretrainArguments, SftArguments
from .training.trainer import Trainer

__version__ = "0.1.0"
__all__ = ["PretrainArguments", "SftArguments", "Trainer", "__version__"]
