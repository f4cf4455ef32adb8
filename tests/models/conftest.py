"""train_here: one-rank `swift-mcore pt|sft` runs in this process (tests/in_process.py)."""

import pytest

from in_process import train_in_process


@pytest.fixture(scope="module")
def train_here(gloo_group):
    """train_here(out, *flags, command="sft"|"pt", base=TINY): train_in_process on this
    module's gloo group."""
    return train_in_process
