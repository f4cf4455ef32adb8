"""Arguments: one dataclass per concern, composed into RunArguments, SftArguments and
RlhfArguments."""

from .checkpoint import CheckpointArguments
from .data import DataArguments
from .logging import LoggingArguments
from .model import ModelArguments
from .parallel import ParallelArguments
from .parser import build_parser, parse_args
from .rlhf import RlhfArguments, RlhfGroupArguments
from .run import PretrainArguments, RunArguments
from .sft import SftArguments, SftDataArguments
from .training import TrainingArguments
from .tuner import TunerArguments

__all__ = [
    "CheckpointArguments", "DataArguments", "LoggingArguments",
    "ModelArguments", "ParallelArguments", "PretrainArguments", "RlhfArguments",
    "RlhfGroupArguments", "RunArguments",
    "SftArguments", "SftDataArguments", "TrainingArguments", "TunerArguments",
    "build_parser", "parse_args",
]
