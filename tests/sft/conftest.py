"""sft_here: one-rank `swift-mcore sft` runs in this process (tests/in_process.py)."""

import pytest

from in_process import train_in_process


@pytest.fixture(scope="module")
def sft_here(gloo_group):
    """sft_here(out, *flags, trainer=None): train_in_process on this module's gloo group."""
    return train_in_process
