"""One finetuning run, stopped and resumed, with everything of docs/tracking.md on:
--report_to tensorboard,wandb,swanlab (offline), --save_safetensors at every save with
--save_total_limit 1, the best checkpoint, early stopping, the plot.

--greater_is_better with val_loss makes the first evaluation (iteration 2, the highest
loss) the best one, so the best checkpoint is the oldest, the one rotation would delete
first, and every later evaluation counts towards --early_stopping_patience 2. The run
stops at iteration 4 (--exit_interval) and resumes: a resume that forgot the best or the
count would keep iteration 4's or 6's evaluation as the best, or stop at 8, not 6.
"""

import json
import os
import random

import pytest
import torch

import tracker_files as T
from run_helpers import run_sft

WORDS = "alpha beta gamma delta river stone cloud paper orange silver north winter".split()
FLAGS = ["--template", "chatml", "--seq_length", "64", "--split_dataset_ratio", "0.25",
         "--train_iters", "10", "--eval_steps", "2", "--eval_iters", "1", "--save_steps", "2",
         "--save_total_limit", "1", "--save_safetensors", "--metric_for_best", "val_loss",
         "--greater_is_better", "true", "--early_stopping_patience", "2",
         "--report_to", "tensorboard,wandb,swanlab", "--tensorboard", "true", "--plot", "true"]
OFFLINE = {"WANDB_MODE": "offline", "SWANLAB_MODE": "offline", "WANDB_SILENT": "true"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tracking")
    rng = random.Random(5)
    data = root / "chats.jsonl"
    with open(data, "w") as fh:
        for _ in range(40):
            words = lambda n: " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, n)))
            fh.write(json.dumps({"messages": [{"role": "user", "content": words(5)},
                                              {"role": "assistant", "content": words(6)}]})
                     + "\n")
    out = root / "run"
    env = {**OFFLINE, "HOME": str(root)}  # no tracker credentials or settings of the user
    first = run_sft(out, "--dataset", data, *FLAGS, "--exit_interval", "4", env=env,
                    timeout=400)
    second = run_sft(out, "--dataset", data, *FLAGS, "--resume", env=env, timeout=400)
    return out, first.stdout, second.stdout


def checkpoint(out, iteration):
    return out / "checkpoint" / f"iter_{iteration:07d}"


def test_trackers_receive_what_metrics_jsonl_has_and_resume_the_same_run(run):
    out, first, second = run
    expected = T.jsonl_values(out)
    assert {("train/loss", it) for it in range(1, 7)} <= set(expected)
    assert {it for key, it in expected if key == "valid/val_loss"} == {2, 4, 6}

    wandb = T.wandb_runs(out)
    ids = json.loads((out / "trackers.json").read_text())
    assert [r["id"] for r in wandb] == [ids["wandb"]] * 2  # the resume continued the run
    assert T.wandb_values(wandb) == expected  # the same floats, bit for bit
    config = wandb[0]["config"]
    assert config["training"]["global_batch_size"] == 8
    assert config["checkpoint"]["metric_for_best"] == "val_loss"

    swanlab = T.swanlab_runs(out)
    assert [r["id"] for r in swanlab] == [ids["swanlab"]] * 2
    logged = {k: v for k, v in T.swanlab_values(swanlab).items()
              if k[0].startswith(("train/", "valid/"))}
    assert logged == expected

    events = T.tensorboard_values(out)
    assert set(events) == set(expected)
    for key, value in expected.items():  # TensorBoard stores float32
        assert abs(events[key] - value) <= 1e-6 * max(1.0, abs(value)), key
    assert "wandb:" in second and "swanlab:" in second


def test_every_save_has_a_hugging_face_folder_rotated_with_its_checkpoint(run, gloo_group):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swift_mcore.loaded_model import forward_logits, load_model

    out, first, second = run
    for it in (2, 4):
        assert f"--save_safetensors: wrote {checkpoint(out, it)}-hf" in first
    assert f"--save_safetensors: wrote {checkpoint(out, 6)}-hf" in second
    names = sorted(os.listdir(out / "checkpoint"))
    # --save_total_limit 1 keeps the newest and the best; iteration 4 went with its folder.
    assert names == ["best", "best-hf", "best.json", "iter_0000002", "iter_0000002-hf",
                     "iter_0000006", "iter_0000006-hf", "latest_checkpointed_iteration.txt"]
    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    for it in (2, 6):
        folder = f"{checkpoint(out, it)}-hf"
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
        ours = load_model(str(checkpoint(out, it)), log=lambda line: None)
        with torch.no_grad():
            theirs = hf(ids).logits
        mine = forward_logits(ours.model, ids)[..., : ours.vocab]
        assert (mine - theirs).abs().max() <= 1e-5, it
        tokenizer = AutoTokenizer.from_pretrained(folder)
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                             tokenize=False)
        assert "<|im_start|>user" in text  # the chat template it was trained with


def test_best_checkpoint_survives_rotation_and_early_stopping_resumes_exactly(run):
    out, first, second = run
    record = json.loads((out / "checkpoint" / "best.json").read_text())
    assert {k: record[k] for k in ("metric", "iteration", "folder", "hf_folder",
                                   "greater_is_better")} == {
        "metric": "val_loss", "iteration": 2, "folder": "iter_0000002",
        "hf_folder": "iter_0000002-hf", "greater_is_better": True}
    valid = {it: v for (key, it), v in T.jsonl_values(out).items() if key == "valid/val_loss"}
    assert record["value"] == valid[2] == max(valid.values())
    assert os.readlink(out / "checkpoint" / "best") == "iter_0000002"
    assert os.readlink(out / "checkpoint" / "best-hf") == "iter_0000002-hf"
    assert "finished at iteration 4 (--exit_interval reached)" in first
    assert ("finished at iteration 6 (early stopping: val_loss did not improve in 2 "
            "evaluations") in second
    state = json.loads((checkpoint(out, 6) / "train_state.json").read_text())
    assert (state["best_iteration"], state["evals_without_improvement"]) == (2, 2)
    resumed = json.loads((checkpoint(out, 2) / "train_state.json").read_text())
    assert (resumed["best_iteration"], resumed["evals_without_improvement"]) == (2, 0)


def test_the_plot_is_written_at_the_end_and_by_the_command(run, tmp_path, capsys):
    from PIL import Image

    from swift_mcore.cli import main
    from swift_mcore.training.plot import read_records

    out, first, second = run
    assert f"plot:         {out / 'loss.png'}" in second
    with Image.open(out / "loss.png") as image:
        assert image.size == (1000, 600)
    records = read_records(str(out / "metrics.jsonl"))
    assert records.resumed_at == [4] and sorted(records.train) == list(range(1, 7))
    again = tmp_path / "again.png"
    assert main(["plot", str(out), "--output", str(again)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {again}"
    with Image.open(again) as image:
        assert image.size == (1000, 600)
