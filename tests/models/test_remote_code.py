"""A Hugging Face folder whose tokenizer needs code shipped in the folder (auto_map): refused
unless --trust_remote_code, by pt/sft (--tokenizer, --model), preprocess, export and infer;
transformers is told trust_remote_code=False explicitly, so it never asks on stdin (it used
to print a [y/N] prompt and wait up to 15 s). The code runs only with the flag."""

import json
import os
import subprocess
import sys

import pytest

import hf_helpers as H
from run_helpers import ROOT, TINY


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny llama folder (model and tokenizer) whose tokenizer class lives in the folder's
    own tokenization_custom.py; importing that module creates MARKER next to the folder."""
    root = tmp_path_factory.mktemp("remote_code")
    path = root / "model"
    H.make_family(str(path), "llama")
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "CustomTokenizer"
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]}
    config_path.write_text(json.dumps(config))
    (path / "tokenization_custom.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(root / 'MARKER')!r}).touch()\n"
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class CustomTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n")
    return path


@pytest.fixture
def marker(folder):
    path = folder.parent / "MARKER"
    if path.exists():
        path.unlink()
    return path


def refusal(flag, folder):
    return (f"{flag} {folder}: the tokenizer needs Python code that ships with the folder "
            f"(tokenization_custom.CustomTokenizer); swift-mcore runs it only with "
            f"--trust_remote_code")


def test_load_tokenizer_refuses_without_the_flag(folder, marker, capsys):
    from swift_mcore.data.tokenizer import load_tokenizer
    from swift_mcore.errors import ArgumentError

    with pytest.raises(ArgumentError) as info:
        load_tokenizer(str(folder))
    assert str(info.value).startswith(refusal("--tokenizer", folder))
    assert "\n" not in str(info.value)
    assert capsys.readouterr().out == ""  # no [y/N] prompt
    assert not marker.exists()


@pytest.mark.parametrize("command", ["pt_tokenizer", "pt_model", "sft_model", "export",
                                     "infer"])
def test_every_command_refuses_without_the_flag(folder, marker, tmp_path, capsys, command):
    from swift_mcore.cli import main

    (tmp_path / "chat.jsonl").write_text(json.dumps({"query": "hi", "response": "yo"}) + "\n")
    train = [*TINY, "--train_iters", "1", "--output_dir", str(tmp_path / "run")]
    shape = {"--num_layers", "--hidden_size", "--num_attention_heads", "--num_query_groups"}
    no_shape = []
    for name, value in zip(train[0::2], train[1::2]):
        if name not in shape:
            no_shape += [name, value]
    argv, flag = {
        "pt_tokenizer": (["pt", *train, "--tokenizer", str(folder)], "--tokenizer"),
        "pt_model": (["pt", *no_shape, "--model", str(folder)], "--model"),
        "sft_model": (["sft", *no_shape, "--model", str(folder), "--dataset",
                       str(tmp_path / "chat.jsonl")], "--model"),
        "export": (["export", "--to_mcore", "--model", str(folder), "--output_dir",
                    str(tmp_path / "mcore")], "--model"),
        "infer": (["infer", "--model", str(folder), "--prompt", "def"], "--model"),
    }[command]
    capsys.readouterr()
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"swift-mcore {command.split('_')[0]}: error: {refusal(flag, folder)}"), captured.err
    assert "Do you wish to run the custom code" not in captured.out
    assert not marker.exists()
    assert not (tmp_path / "mcore").exists()


def preprocess(folder, tmp_path, *flags):
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "def add(a, b):"}) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONWARNINGS="ignore", HF_MODULES_CACHE=str(tmp_path / "hf_modules"))
    return subprocess.run(
        [sys.executable, "-m", "swift_mcore", "preprocess", "--input",
         str(tmp_path / "docs.jsonl"), "--output_prefix", str(tmp_path / "data"),
         "--tokenizer", str(folder), "--workers", "1", "--progress_bar", "false", *flags],
        capture_output=True, text=True, timeout=240, cwd=ROOT, env=env,
        stdin=subprocess.DEVNULL)


def test_preprocess_without_a_terminal_neither_asks_nor_runs_the_code(folder, marker,
                                                                       tmp_path):
    proc = preprocess(folder, tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"swift-mcore preprocess: error: {refusal('--tokenizer', folder)} (read that code "
        f"first)"], proc.stderr
    assert proc.stdout == ""  # transformers' "Do you wish to run the custom code? [y/N]"
    assert not marker.exists() and not (tmp_path / "data.bin").exists()


def test_trust_remote_code_runs_it(folder, marker, tmp_path):
    proc = preprocess(folder, tmp_path, "--trust_remote_code")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marker.exists() and (tmp_path / "data.bin").exists()


def test_a_saved_run_never_lends_its_trust_to_export_or_infer():
    from swift_mcore.arguments.export import ExportArguments
    from swift_mcore.arguments.infer import InferArguments
    from swift_mcore.loaded_model import one_process_flags
    from swift_mcore.preprocess import PreprocessArguments

    saved = {"data": {"trust_remote_code": True}, "model": {"hidden_size": 64}}
    flags = one_process_flags(saved)
    assert flags.data.trust_remote_code is False and flags.model.hidden_size == 64
    for cls in (ExportArguments, InferArguments, PreprocessArguments):
        assert cls().trust_remote_code is False
