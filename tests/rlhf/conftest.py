"""One tiny Hugging Face causal LM and a preference file, shared by the rlhf tests."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

import hf_helpers as H  # noqa: E402

ROWS = [
    {"prompt": "def add(a, b):", "chosen": "\n    return a + b", "rejected": " pass"},
    {"prompt": "def sub(a, b):", "chosen": "\n    return a - b", "rejected": "\n    return b"},
    {"prompt": "x = ", "chosen": "1 + 2", "rejected": "add(1)"},
    {"prompt": "def f():", "chosen": " return 0", "rejected": "\n    return a + b + b"},
]


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """(HF folder, preference jsonl): a 2-layer Llama of vocabulary ~300 and four pairs."""
    root = tmp_path_factory.mktemp("rlhf")
    folder = root / "hf"
    H.make_model(str(folder), "llama", initializer_range=0.02)
    data = root / "prefs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return folder, data


def run_flags(*extra):
    """A one-rank rlhf run on tiny_hf: everything that is not the model's shape."""
    return ["--seq_length", "64", "--micro_batch_size", "4", "--global_batch_size", "4",
            "--lr", "1e-3", "--min_lr", "1e-3", "--lr_decay_style", "constant",
            "--log_interval", "1", "--eval_steps", "0", "--progress_bar", "false",
            "--tensorboard", "false", "--plot", "false", "--num_workers", "0", *extra]
