"""A reward model leaves swift-mcore as transformers' *ForSequenceClassification: `export
--to_hf` of an rm run writes a folder AutoModelForSequenceClassification loads and scores
identically, `infer` prints the score, and a score folder converts both ways bit for bit."""

import json

import pytest
import torch

import hf_helpers as H
from in_process import train_in_process
from reward_helpers import hf_scores, make_score_model
from rlhf_helpers import run_flags

TEXT = "def add(a, b):\n    return a + b"


def infer_score(folder, capsys) -> float:
    from swift_mcore.arguments.infer import InferArguments
    from swift_mcore.infer import run

    capsys.readouterr()
    run(InferArguments(model=str(folder), prompt=TEXT).validate())
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines
    return float(lines[0])


def test_export_scores_identically_and_infer_prints_scores(tiny_hf, tmp_path, gloo_group,
                                                            capsys):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from swift_mcore.loaded_model import load_model
    from swift_mcore.models.value_head import score_sequences
    from swift_mcore.training.reward_trainer import RewardTrainer

    folder, data = tiny_hf
    run = tmp_path / "run"
    train_in_process(run, "--rlhf_type", "rm", "--model", folder, "--dataset", data,
                     "--train_iters", "2", *run_flags("--micro_batch_size", "2"),
                     command="rlhf", base=[], trainer=RewardTrainer)
    out = tmp_path / "hf"
    H.convert(run, out, "to_hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert config["pad_token_id"] == tokenizer.eos_token_id  # the tokenizer has no pad token
    model, info = AutoModelForSequenceClassification.from_pretrained(
        str(out), output_loading_info=True)
    assert model.config.num_labels == 1
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    assert "lm_head.weight" not in H.safetensors_state(str(out))

    texts = [TEXT, "x = 1 + 2", "def f(): pass", "return"]
    sequences = [tokenizer(text=t + tokenizer.eos_token)["input_ids"] for t in texts]
    theirs = hf_scores(out, sequences)
    loaded = load_model(str(run), log=lambda line: None)
    ours = score_sequences(loaded.model, sequences, tokenizer.eos_token_id)[:, 0]
    assert theirs.abs().max() > 1e-3 and theirs.std() > 1e-4
    assert (ours - theirs).abs().max().item() <= 1e-5

    assert infer_score(run, capsys) == pytest.approx(theirs[0].item(), abs=1e-5)
    assert infer_score(out, capsys) == pytest.approx(theirs[0].item(), abs=1e-5)


def test_a_score_folder_converts_both_ways_bit_for_bit(tmp_path, gloo_group):
    """*ForSequenceClassification -> checkpoint (scores within 1e-4) -> the same folder."""
    source = tmp_path / "score"
    make_score_model(source, "qwen2")
    config = H.check_round_trip(source, tmp_path)
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
    assert config["id2label"] == {"0": "LABEL_0"}


def test_infer_refuses_a_template_for_a_reward_model(tmp_path, gloo_group):
    from swift_mcore.arguments.infer import InferArguments
    from swift_mcore.errors import ArgumentError
    from swift_mcore.infer import run

    source = tmp_path / "score"
    make_score_model(source)
    with pytest.raises(ArgumentError, match="is a reward model, which scores text"):
        run(InferArguments(model=str(source), prompt="hi", template="chatml").validate())
