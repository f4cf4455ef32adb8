"""Hugging Face folders without tokenizer files convert without one (export needs only the
weights and config.json); training and infer ask for --tokenizer; a folder whose tokenizer
is only a SentencePiece tokenizer.model loads."""

import io
import json
import os
import subprocess
import sys

import pytest
import torch

import hf_helpers as H
from run_helpers import ROOT
from swift_mcore.errors import ArgumentError

NO_TOKENIZER = ("holds no tokenizer (none of tokenizer.json, tokenizer_config.json, "
                "tokenizer.model ...): a folder of weights only; give the tokenizer with "
                "--tokenizer PATH")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("weights-only") / "llama"
    H.make_model(str(path), "llama", tokenizer=False)
    assert sorted(os.listdir(path)) == ["config.json", "generation_config.json",
                                        "model.safetensors"]
    return path


def convert(source, out, direction):
    from swift_mcore.arguments.export import ExportArguments
    from swift_mcore.export import run

    args = ExportArguments(model=str(source), output_dir=str(out), **{direction: True})
    return run(args.validate(), log=lambda line: None)


def test_a_llama_folder_without_tokenizer_converts_both_ways(tmp_path, gloo_group, llama):
    convert(llama, tmp_path / "mcore", "to_mcore")
    convert(tmp_path / "mcore", tmp_path / "back", "to_hf")
    original, back = H.safetensors_state(str(llama)), H.safetensors_state(str(tmp_path / "back"))
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    assert not any(n.startswith("tokenizer") for n in os.listdir(tmp_path / "back"))
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["vocab_size"] == 320 and config["model_type"] == "llama"


def test_training_and_infer_ask_for_a_tokenizer(tmp_path, gloo_group, llama):
    from swift_mcore.arguments import RunArguments
    from swift_mcore.data import build_tokenizer
    from swift_mcore.loaded_model import load_model

    with pytest.raises(ArgumentError) as err:
        build_tokenizer(RunArguments.from_flags(model=str(llama)))
    assert str(err.value) == f"--model {llama} {NO_TOKENIZER} (a Hugging Face tokenizer " \
                             f"folder or a tokenizer.json file)"
    with pytest.raises(ArgumentError, match="give the tokenizer with --tokenizer PATH"):
        load_model(str(llama), log=lambda line: None)
    # The CLI: one line naming --tokenizer, exit 2, no traceback.
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "infer", "--model", str(llama),
                           "--prompt", "hi"], capture_output=True, text=True, timeout=240,
                          cwd=ROOT, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert NO_TOKENIZER in proc.stderr and "Traceback" not in proc.stderr


def test_a_sentencepiece_tokenizer_model_folder_loads(tmp_path):
    import sentencepiece as spm

    from swift_mcore.data.templates import Template
    from swift_mcore.data.tokenizer import load_tokenizer

    words = "alpha beta gamma delta river stone cloud paper orange silver".split()
    lines = [" ".join(words[(k * j) % 10] for j in range(8)) for k in range(200)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model,
                                   vocab_size=100, model_type="bpe", unk_id=0, bos_id=1,
                                   eos_id=2, pad_id=-1, minloglevel=2)
    folder = tmp_path / "llama2-style"
    H.make_model(str(folder), "llama", tokenizer=False, vocab_size=100, bos_token_id=1,
                 eos_token_id=2)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    tokenizer = load_tokenizer(str(folder), flag="--model")
    reference = spm.SentencePieceProcessor(model_proto=model.getvalue())
    text = "alpha river cloud silver"
    assert tokenizer.encode(text) == reference.encode(text)
    assert tokenizer.decode(tokenizer.encode(text)).strip() == text
    assert (tokenizer.eod, tokenizer.vocab_size) == (2, 100)
    ids, turns = Template("plain", tokenizer).encode(
        [{"role": "user", "content": "alpha"}, {"role": "assistant", "content": "beta"}])
    assert ids[-1] == 2 and turns[-1] == 0  # sft works with it (fast backend, EOD trained)
