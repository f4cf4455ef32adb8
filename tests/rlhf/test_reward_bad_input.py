"""Bad reward-model input: one line naming the flag, file, row or field, exit 2, before any
work (nothing written)."""

import json
import subprocess
import sys

import pytest

from reward_helpers import make_score_model
from rlhf_helpers import run_flags
from run_helpers import ROOT, child_env


def test_a_margin_that_is_no_number_is_refused_naming_the_row(tiny_hf, tmp_path):
    folder, _ = tiny_hf
    data = tmp_path / "prefs.jsonl"
    data.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c", "margin": 1})
                    + "\n" + json.dumps({"prompt": "a", "chosen": "b", "rejected": "c",
                                         "margin": "high"}) + "\n")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "swift_mcore", "rlhf", "--rlhf_type", "rm", "--model",
         str(folder), "--dataset", str(data), "--output_dir", str(out), "--train_iters", "1",
         *run_flags()],
        capture_output=True, text=True, timeout=240, cwd=ROOT, env=child_env())
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"swift-mcore rlhf: error: --dataset {data}, row 1: 'margin' must be a finite "
        f"number, got 'high'"]
    assert not (out / "checkpoint").exists() and not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("row, message", [
    ({"prompt": "a", "completion": "b", "label": True},
     "row 3: an unpaired row \\(prompt/completion/label, TRL's KTO format\\); this task "
     "trains on pairs"),
    ({"prompt": "a", "chosen": "b"}, "row 3: no 'rejected' answer"),
    ({"prompt": "a", "chosen": "b", "rejected": "c", "margin": float("nan")},
     "row 3: 'margin' must be a finite number, got nan"),
    ({"prompt": "a", "chosen": "b", "rejected": "c", "margin": True},
     "row 3: 'margin' must be a finite number, got True"),
    ({"prompt": "a", "chosen": "b", "rejected": "c", "margin": [1]},
     "row 3: 'margin' must be a finite number"),
])
def test_malformed_rows_name_the_row(row, message):
    from swift_mcore.data.preference import to_pair
    from swift_mcore.errors import ArgumentError

    with pytest.raises(ArgumentError, match=f"^--dataset d.jsonl, {message}"):
        to_pair(row, "--dataset d.jsonl, row 3")


def test_margins_on_some_rows_and_rows_over_max_length_are_refused(tiny_hf):
    from transformers import AutoTokenizer

    from swift_mcore.data.preference import to_pair
    from swift_mcore.data.reward_pairs import encode_reward_pairs
    from swift_mcore.errors import ArgumentError

    hf = AutoTokenizer.from_pretrained(str(tiny_hf[0]))
    rows = [{"prompt": "x", "chosen": "y", "rejected": "z", "margin": 1.0},
            {"prompt": "x", "chosen": "y", "rejected": "z"}]
    pairs = [to_pair(r, f"--dataset d.jsonl, row {i}") for i, r in enumerate(rows)]
    with pytest.raises(ArgumentError, match="^--dataset d.jsonl, row 1: no 'margin', while "
                                            "--dataset d.jsonl, row 0 has one"):
        encode_reward_pairs(pairs, hf, 64)
    rows = [{"prompt": "x", "chosen": "y", "rejected": "z"},
            {"prompt": "x", "chosen": "def add(a, b): " * 8, "rejected": "z"},
            {"prompt": "x", "chosen": "y", "rejected": "def sub(a, b): " * 8}]
    pairs = [to_pair(r, f"--dataset d.jsonl, row {i}") for i, r in enumerate(rows)]
    with pytest.raises(ArgumentError, match=r"^2 of 3 rows have an answer of more than "
                                            r"--max_length 16 tokens with its prompt \(first: "
                                            r"--dataset d.jsonl, row 1\)"):
        encode_reward_pairs(pairs, hf, 16)
    assert len(encode_reward_pairs(pairs, hf, 200)[0]) == 3


@pytest.mark.parametrize("flags, message", [
    (["--rlhf_type", "rm", "--beta", "0.2"], "^--beta is a DPO flag; --rlhf_type rm"),
    (["--rlhf_type", "rm", "--ref_model", "x"], "^--ref_model is a DPO flag"),
    (["--rlhf_type", "rm", "--num_labels", "2"], "^--num_labels 2: a reward model has one"),
    (["--rlhf_type", "rm", "--max_length", "65"], "^--max_length 65 exceeds --seq_length 64 "
                                                  "\\(a reward model reads whole sequences\\)"),
    (["--center_rewards_coefficient", "0.1"], "^--center_rewards_coefficient is a reward "
                                              "model's \\(--rlhf_type rm\\)"),
])
def test_bad_flags_are_refused_naming_the_flag(flags, message, tmp_path):
    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.errors import ArgumentError
    from swift_mcore.run_config import resolve

    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    argv = ["--dataset", str(data), "--output_dir", str(tmp_path / "o"), *run_flags(*flags)]
    with pytest.raises(ArgumentError, match=message):
        resolve(parse_args(argv, prog="swift-mcore rlhf", cls=RlhfArguments), world_size=1)


@pytest.mark.parametrize("command, extra", [("sft", []), ("rlhf", []), ("pt", ["--lr_warmup_iters", "0"])])
def test_a_score_model_trains_only_as_a_reward_model(command, extra, tmp_path, capsys):
    """sft, pt and DPO train next-token heads: a *ForSequenceClassification --model (or
    --num_labels) is refused in one line before anything is written."""
    from swift_mcore import cli

    folder = tmp_path / "score"
    make_score_model(folder)
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c",
                                "messages": None, "query": "a", "response": "b"}) + "\n")
    out = tmp_path / "out"
    data_flags = ["--dataset", str(data)] if command != "pt" else []
    argv = ["--model", str(folder), *data_flags, "--output_dir", str(out), "--train_iters",
            "1", *extra]
    capsys.readouterr()
    code = {"sft": cli.run_sft, "rlhf": cli.run_rlhf, "pt": cli.run_pretrain}[command](argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [f"swift-mcore {command}: error: --model {folder} is a reward model "
                   f"(*ForSequenceClassification): `swift-mcore {command}` trains a causal "
                   f"LM's next-token head; train a reward model with `swift-mcore rlhf "
                   f"--rlhf_type rm`"]
    assert not out.exists()


def test_a_score_folder_of_two_labels_is_refused(tmp_path):
    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.errors import ArgumentError
    from swift_mcore.run_config import resolve

    folder = tmp_path / "score"
    make_score_model(folder)
    config = json.loads((folder / "config.json").read_text())
    config["id2label"] = {"0": "bad", "1": "good"}
    (folder / "config.json").write_text(json.dumps(config))
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    argv = ["--rlhf_type", "rm", "--model", str(folder), "--dataset", str(data),
            "--output_dir", str(tmp_path / "o"), *run_flags()]
    with pytest.raises(ArgumentError, match="architectures LlamaForSequenceClassification "
                                            "with 2 labels \\(id2label\\): only 1"):
        resolve(parse_args(argv, prog="swift-mcore rlhf", cls=RlhfArguments), world_size=1)


def test_a_checkpoint_of_another_head_is_refused_naming_num_labels():
    """A causal LM's checkpoint --load'ed into a reward model (or back) names the flag."""
    from swift_mcore.checkpointing.compat import model_differences

    assert model_differences({"model": {"num_labels": None}}, {"model": {"num_labels": 1}}) \
        == ["--num_labels: checkpoint unset, now 1"]
