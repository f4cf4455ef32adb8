"""Paths a checkpoint records (--model, --tokenizer, --ref_model, --load): typed relative,
they are recorded absolute, so export, infer and a resume find them from any working
directory; an older checkpoint's relative --model still loads from where it was made, and
elsewhere the error names the path and says it was relative."""

import json
import os

import pytest

import hf_helpers as H
from test_hf_training import run_flags
from test_model_sizes import reseal

from swift_mcore.arguments import RlhfArguments
from swift_mcore.errors import ArgumentError, CheckpointError
from swift_mcore.run_config import resolve

# how a message names a path an older checkpoint recorded relative to its run's directory
RELATIVE = ("(a relative path, recorded by an older swift-mcore: from the working directory "
            "of the run that saved it; run from there)")
LORA = ["--tuner_type", "lora", "--lora_rank", "2", "--lora_dropout", "0",
        "--attention_backend", "sdpa"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, gloo_group):
    """A one-iteration LoRA run on a tiny Llama folder typed as the relative path `hf`."""
    from in_process import train_in_process

    root = tmp_path_factory.mktemp("relpath")
    H.make_family(str(root / "hf"), "llama", initializer_range=0.05)
    (root / "data.jsonl").write_text("".join(
        json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"}) + "\n"
        for i in range(40)))
    here = os.getcwd()
    os.chdir(root)
    try:
        train_in_process("run", "--model", "hf", "--tokenizer", "hf", "--dataset", "data.jsonl",
                         "--train_iters", "1", "--save_steps", "1", *LORA, command="pt",
                         base=run_flags())
    finally:
        os.chdir(here)
    return root


def test_a_lora_checkpoint_made_from_a_relative_model_loads_from_elsewhere(
        lora_run, tmp_path, monkeypatch):
    from swift_mcore.loaded_model import load_model

    root = lora_run
    checkpoint = root / "run" / "checkpoint"
    monkeypatch.chdir(tmp_path)  # another working directory: `hf` is nothing here
    loaded = load_model(str(checkpoint), log=lambda line: None)
    assert loaded.hf_folder == str(root / "hf")
    [saved] = {json.loads(p.read_text())["model"]["model"]
               for p in checkpoint.glob("*/args.json")}
    assert saved == str(root / "hf")
    assert {json.loads(p.read_text())["data"]["tokenizer"]
            for p in checkpoint.glob("*/args.json")} == {str(root / "hf")}


def edited_copy(root, name, edit):
    """A copy of lora_run's checkpoint whose args.json ``edit`` changed (resealed)."""
    import shutil

    copy = root / name
    shutil.copytree(root / "run" / "checkpoint", copy)
    for path in copy.glob("*/args.json"):
        args = json.loads(path.read_text())
        edit(args)
        path.write_text(json.dumps(args))
        reseal(path.parent)
    return copy


def test_an_older_relative_record_loads_where_it_was_made_and_is_named_elsewhere(
        lora_run, tmp_path, monkeypatch):
    from swift_mcore.loaded_model import load_model

    root = lora_run

    def as_before(args):  # as swift-mcore recorded it before
        args["model"]["model"] = args["data"]["tokenizer"] = "hf"

    old = edited_copy(root, "old", as_before)
    monkeypatch.chdir(root)
    assert load_model(str(old), log=lambda line: None).hf_folder == "hf"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError) as err:
        load_model(str(old), log=lambda line: None)
    assert f"LoRA adapters for the base model hf {RELATIVE}, which is no longer a Hugging Face " \
           "folder" in str(err.value)

    def tokenizer_before(args):
        args["data"]["tokenizer"] = "hf"

    old_tokenizer = edited_copy(root, "old_tokenizer", tokenizer_before)
    with pytest.raises(ArgumentError) as err:
        load_model(str(old_tokenizer), log=lambda line: None)
    assert f"was trained with the tokenizer of hf {RELATIVE}, which no longer exists; pass " \
           "--tokenizer PATH" in str(err.value)


def test_a_lost_adapters_folder_is_named_as_the_checkpoint_recorded_it(lora_run):
    from swift_mcore.loaded_model import load_model

    def continued(args):  # a run that continued a peft adapter, since moved away
        args["tuner"]["adapters"] = "peft"

    folder = edited_copy(lora_run, "continued", continued)
    with pytest.raises(CheckpointError) as err:
        load_model(str(folder), log=lambda line: None)
    assert f"continued the peft adapter peft {RELATIVE} (--adapters), which is no longer a " \
           "folder" in str(err.value)


def test_ref_model_and_load_are_recorded_absolute(lora_run, monkeypatch):
    root = lora_run
    monkeypatch.chdir(root)
    (root / "prefs.jsonl").write_text(json.dumps(
        {"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    args = RlhfArguments.from_flags(
        model="hf", ref_model="./hf", dataset=["prefs.jsonl"], rlhf_type="dpo",
        load=os.path.join("run", "checkpoint"), finetune=True, seq_length=32,
        micro_batch_size=1, global_batch_size=1, train_iters=1, output_dir="dpo")
    config = resolve(args, world_size=1)
    assert config.rlhf.ref_model == config.model.model == str(root / "hf")
    assert config.checkpoint.load == str(root / "run" / "checkpoint")
    assert args.model.model == "hf"  # the caller's flags stay as given
