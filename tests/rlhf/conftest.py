"""One tiny Hugging Face causal LM and a preference file, shared by the rlhf tests."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

import hf_helpers as H  # noqa: E402
from rlhf_helpers import KTO_ROWS, ROWS  # noqa: E402


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """(HF folder, preference jsonl): a 2-layer Llama of vocabulary ~300 and four pairs."""
    root = tmp_path_factory.mktemp("rlhf")
    folder = root / "hf"
    H.make_model(str(folder), "llama", initializer_range=0.02)
    data = root / "prefs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return folder, data


@pytest.fixture(scope="session")
def kto_file(tiny_hf):
    """A jsonl of KTO_ROWS (TRL's unpaired prompt/completion/label) beside tiny_hf."""
    data = tiny_hf[1].parent / "kto.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in KTO_ROWS))
    return data
