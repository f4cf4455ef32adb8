"""A reward model stops and resumes bit-exactly (the metrics included), and trains with
LoRA: the adapters and the whole score head train, the base stays frozen, and the merged
export scores as the LoRA checkpoint does."""

import json
import subprocess
import sys

import pytest
import torch

import hf_helpers as H
from in_process import train_in_process
from reward_helpers import MARGIN_ROWS, hf_scores
from rlhf_helpers import run_flags
from run_helpers import ROOT, child_env

KEEP = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
        "accuracy", "margin", "mean_reward", "min_reward", "max_reward", "grad_norm")


def argv(folder, data, *flags):
    return ["--rlhf_type", "rm", "--model", str(folder), "--dataset", str(data),
            "--train_iters", "4", "--center_rewards_coefficient", "0.01",
            *run_flags("--micro_batch_size", "2", *map(str, flags))]


def trained(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: {k: r[k] for k in KEEP} for r in rows if "loss" in r}


def rm(out, folder, data, *flags):
    """A real process: what a resume checked for exactness must start from."""
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "rlhf", "--output_dir",
                           str(out), *argv(folder, data, *flags)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def margin_data(tmp_path_factory):
    data = tmp_path_factory.mktemp("rm_data") / "prefs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in MARGIN_ROWS))
    return data


def test_resume_is_bit_exact(tiny_hf, margin_data, tmp_path, gloo_group):
    from swift_mcore.training.reward_trainer import RewardTrainer

    folder, _ = tiny_hf
    train_in_process(tmp_path / "whole", *argv(folder, margin_data), command="rlhf", base=[],
                     trainer=RewardTrainer)
    split = tmp_path / "split"
    rm(split, folder, margin_data, "--exit_interval", "2")
    assert sorted(trained(split)) == [1, 2]
    proc = rm(split, folder, margin_data, "--resume")
    assert "starting at iteration 2" in proc.stdout
    whole = trained(tmp_path / "whole")
    assert sorted(whole) == [1, 2, 3, 4]
    assert trained(split) == whole  # bit-equal, the metrics included
    assert whole[4]["rewards/margins"] > whole[1]["rewards/margins"]  # it learns


def test_lora_trains_the_head_whole_and_exports_merged(tiny_hf, margin_data, tmp_path,
                                                       gloo_group):
    from transformers import AutoTokenizer

    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.errors import ArgumentError
    from swift_mcore.loaded_model import load_model
    from swift_mcore.models.value_head import score_sequences
    from swift_mcore.run_config import resolve
    from swift_mcore.runtime import run_lock
    from swift_mcore.training.reward_trainer import RewardTrainer

    folder, _ = tiny_hf
    run = tmp_path / "run"
    flags = [*argv(folder, margin_data, "--tuner_type", "lora", "--lora_rank", "4"),
             "--output_dir", str(run)]
    trainer = RewardTrainer(resolve(parse_args(flags, prog="swift-mcore rlhf",
                                               cls=RlhfArguments), world_size=1))
    trainer.setup()
    trainable = sorted(n.removeprefix("module.") for n, p in
                       trainer.model[0].named_parameters() if p.requires_grad)
    start = {n: p.detach().clone() for n, p in trainer.model[0].named_parameters()}
    trainer.writer.close()
    trainer.watchdog.close()
    run_lock.release(str(run))
    assert "output_layer.weight" in trainable
    assert all("lora_" in n for n in trainable if n != "output_layer.weight")
    assert len(trainable) > 1

    train_in_process(run, *flags[:-2], command="rlhf", base=[], trainer=RewardTrainer)
    loaded = load_model(str(run), log=lambda line: None)
    now = {n: p for n, p in loaded.model.named_parameters()}
    head = "output_layer.weight"
    assert not torch.equal(now[head], start["module." + head])  # the head trained
    frozen = "decoder.layers.0.mlp.linear_fc2.base_layer.weight"
    assert torch.equal(now[frozen], start["module." + frozen])  # the base did not

    out = tmp_path / "hf"
    # without --merge_lora: the one way that writes a reward model (it offered --to_peft,
    # which refuses a score head)
    with pytest.raises(ArgumentError, match=f"^--model {run} is a LoRA checkpoint \\(adapters "
                                            f"only\\): add --merge_lora to write the merged "
                                            f"model$"):
        H.convert(run, out, "to_hf")
    H.convert(run, out, "to_hf", merge_lora=True)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    sequences = [tokenizer(text=r["prompt"] + r["chosen"] + tokenizer.eos_token)["input_ids"]
                 for r in MARGIN_ROWS]
    ours = score_sequences(loaded.model, sequences, tokenizer.eos_token_id)[:, 0]
    theirs = hf_scores(out, sequences)
    assert (ours - theirs).abs().max().item() <= 1e-5
