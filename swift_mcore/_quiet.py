"""Silences third-party warnings that say nothing to a swift-mcore user."""

import logging
import warnings

_MESSAGES = (
    "Apex is not installed",
    "Transformer Engine",
    "transformer_engine",
    "TE is not installed",
    "nvidia-modelopt",
    "full scope is deprecated",
)


def quiet_third_party() -> None:
    for message in _MESSAGES:
        warnings.filterwarnings("ignore", message=f".*{message}.*")
    logging.getLogger("megatron").setLevel(logging.WARNING)
