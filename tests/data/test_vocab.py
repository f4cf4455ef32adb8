"""Tokenizer vs model vocabulary: padding to --make_vocab_size_divisible_by x TP, and a
tokenizer larger than --vocab_size refused before training starts."""

import subprocess
import sys
from pathlib import Path

import pytest

from swift_mcore.errors import ArgumentError
from swift_mcore.arguments import RunArguments
from swift_mcore.run_config import padded_vocab, resolve

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("vocab, divisible_by, tp, padded", [
    (4096, 128, 1, 4096), (4097, 128, 1, 4224), (4000, 128, 2, 4096), (4097, 128, 2, 4352),
    (50257, 128, 1, 50304), (50257, 128, 8, 51200), (100, 1, 1, 100),
])
def test_padding_rule(vocab, divisible_by, tp, padded):
    assert padded_vocab(vocab, divisible_by, tp) == padded


def resolved(tokenizer, world_size=1, **flags):
    args = RunArguments.from_flags(**flags)
    config = resolve(args, world_size=world_size, cuda=False)
    return config.complete(tokenizer.vocab_size, None).padded_vocab_size


def test_model_vocabulary_comes_from_the_tokenizer_or_the_flag(tokenizer):
    assert tokenizer.vocab_size == 4096
    assert resolved(tokenizer) == 4096
    assert resolved(tokenizer, make_vocab_size_divisible_by=1000) == 5000
    assert resolved(tokenizer, vocab_size=5000) == 5120
    assert resolved(tokenizer, 2, vocab_size=5000, tensor_model_parallel_size=2) == 5120
    assert resolved(tokenizer, 2, vocab_size=5121, tensor_model_parallel_size=2) == 5376


def test_tokenizer_larger_than_the_model_is_refused(tokenizer):
    with pytest.raises(ArgumentError, match=r"the tokenizer has 4096 tokens but --vocab_size "
                                            r"is 4095"):
        resolved(tokenizer, vocab_size=4095)


def test_cli_refuses_it_before_training(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "swift_mcore", "pt", "--vocab_size", "1000", "--train_iters", "2",
         "--lr_warmup_iters", "1", "--output_dir", str(out)],
        capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: the tokenizer has 4096 tokens but --vocab_size is 1000" in proc.stderr
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoint").exists()
