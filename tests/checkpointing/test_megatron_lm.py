"""Megatron-LM checkpoints in swift-mcore: the checkpoint in tests/fixtures/megatron_lm (written by
Megatron-LM's own save_checkpoint, see its README) resumes with its weights, optimizer,
scheduler and counters (logits and the next step's loss within 1e-5 of Megatron-LM's), loads
with --load --finetune, is never taken for a half-finished save, and a tampered common.pt runs
nothing."""

import json
import os
import shutil
import signal

import numpy as np
import pytest
import torch

import ckpt_harness as H
import tamper as T
from swift_mcore.arguments import PretrainArguments
from swift_mcore.errors import CheckpointError

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "fixtures", "megatron_lm")
REFERENCE = os.path.join(FIXTURE, "reference")
# The fixture's model and run (its README's argv), in swift-mcore's flags.
FLAGS = dict(
    num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
    num_query_groups=2, seq_length=64, max_position_embeddings=64, vocab_size=511,
    untie_embeddings_and_output_weights=True, swiglu=True, normalization="RMSNorm",
    micro_batch_size=2, global_batch_size=8, lr=1e-3, min_lr=1e-4, lr_warmup_iters=2,
    lr_decay_style="linear", train_iters=20, weight_decay=0.01, seed=1234, clip_grad=1.0,
    adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
    hidden_dropout=0.0, attention_dropout=0.0, eval_steps=0, num_workers=0,
    tensorboard=False, plot=False, progress_bar=False, log_interval=1,
)


@pytest.fixture(scope="module")
def data_flags(tmp_path_factory):
    """A byte-level BPE of 300 tokens (the fixture's vocabulary is 511, padded to 512) and a
    small corpus: the data only has to exist, the checked batches are the fixture's."""
    from swift_mcore.data.tokenizer import train_bpe

    folder = tmp_path_factory.mktemp("mlm_data")
    corpus = H.write_corpus(str(folder / "corpus.jsonl"), n_docs=60, words=40)
    with open(corpus) as fh:
        docs = [json.loads(line)["text"] for line in fh]
    path = str(folder / "tokenizer.json")
    train_bpe(docs, vocab_size=300).save(path)
    return {"tokenizer": path, "dataset": [corpus], "split": "90,10,0"}


@pytest.fixture
def mlm_root(tmp_path):
    root = tmp_path / "mlm_run"
    shutil.copytree(FIXTURE, root, ignore=shutil.ignore_patterns("reference", "README.md"))
    return str(root)


@pytest.fixture
def in_process(gloo_group, data_flags):
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    trainers = []

    def setup(**flags):
        from swift_mcore.training.trainer import Trainer

        trainer = Trainer(PretrainArguments.from_flags(**{**FLAGS, **data_flags, **flags}))
        trainers.append(trainer)
        trainer.setup()
        return trainer

    yield setup
    for t in trainers:
        if getattr(t, "writer", None) is not None:
            t.writer.close()
    for s, handler in saved.items():
        signal.signal(s, handler)


def logits(trainer):
    ids = torch.from_numpy(np.load(os.path.join(REFERENCE, "input_ids.npy")))
    model = trainer.model[0]
    model.eval()
    mask = torch.tril(torch.ones(64, 64)).unsqueeze(0).unsqueeze(0).expand(2, 1, 64, 64) < 0.5
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=torch.arange(64).expand(2, 64),
                    attention_mask=mask)
    model.train()
    return out.float().numpy()


def next_step_batches():
    with open(os.path.join(REFERENCE, "next_step.json")) as fh:
        ref = json.load(fh)
    text = torch.tensor(ref["batch"]["text_token_ids"], dtype=torch.int64)
    batches = []
    for m in range(4):
        rows = text[2 * m:2 * m + 2]
        batches.append({"tokens": rows[:, :-1], "labels": rows[:, 1:],
                        "loss_mask": torch.ones(2, 64), "position_ids": torch.arange(64).expand(2, 64),
                        "sample_ids": torch.arange(2 * m, 2 * m + 2)})
    return ref, iter(batches)


def param_stats(trainer):
    from swift_mcore.checkpointing.io import unwrap

    return {name: (p.detach().double().sum().item(), p.detach().double().norm().item())
            for name, p in unwrap(trainer.model[0]).named_parameters()}


def test_resume_megatron_lm_checkpoint(in_process, tmp_path, mlm_root, capsys):
    """--resume ROOT (the tracker names iteration 10): counters, weights (logits), optimizer
    and scheduler (the next step's loss, lr and every parameter after the Adam update) are
    Megatron-LM's within 1e-5; what is not restored is named in the log."""
    trainer = in_process(output_dir=str(tmp_path / "out"), resume=mlm_root)
    log = capsys.readouterr().out
    folder = os.path.join(mlm_root, "iter_0000010")
    assert f"resumed from {folder} (a Megatron-LM checkpoint): iteration 10, 80 train samples" \
        in log and "restored model, optimizer, LR scheduler (step 10, lr 0.0006)" in log, log
    assert "RNG states NOT restored: it is a Megatron-LM checkpoint" in log
    assert "NOT checked against the Megatron-LM checkpoint: the training data" in log
    s = trainer.state
    assert (s.iteration, s.consumed_train_samples, s.consumed_valid_samples,
            s.skipped_train_samples) == (10, 80, 0, 0)
    assert s.floating_point_operations_so_far == 3523215360.0
    assert trainer.scheduler.num_steps == 10
    np.testing.assert_allclose(logits(trainer),
                               np.load(os.path.join(REFERENCE, "logits_iter10.npy")),
                               rtol=0, atol=1e-5)

    ref, trainer.train_iterator = next_step_batches()
    step = trainer.train_step()
    assert abs(step["loss"] - ref["loss"]) < 1e-5
    assert abs(step["grad_norm"] - ref["grad_norm"]) < 1e-5
    assert step["lr"] == pytest.approx(ref["lr_after_scheduler_step"], rel=1e-12)
    stats = param_stats(trainer)
    for name, want in ref["param_stats_after_update"].items():
        got_sum, got_l2 = stats[name]
        assert abs(got_l2 - want["l2"]) <= 1e-5 * max(1.0, abs(want["l2"])), name
        assert abs(got_sum - want["sum"]) <= 1e-5 * max(1.0, abs(want["sum"])), name


def test_finetune_from_megatron_lm_iter_folder(in_process, tmp_path, mlm_root, capsys):
    """--load ITER_FOLDER --finetune: the weights only; counters, optimizer and schedule fresh."""
    folder = os.path.join(mlm_root, "iter_0000010")
    trainer = in_process(output_dir=str(tmp_path / "ft"), load=folder, finetune=True)
    assert f"--finetune: model weights from {folder}" in capsys.readouterr().out
    assert trainer.state.iteration == 0 and trainer.scheduler.num_steps == 0
    np.testing.assert_allclose(logits(trainer),
                               np.load(os.path.join(REFERENCE, "logits_iter10.npy")),
                               rtol=0, atol=1e-5)


def test_a_megatron_lm_checkpoint_is_not_a_half_finished_save(mlm_root):
    """Recognised as Megatron-LM's, complete; a truncated .distcp is named as such."""
    from swift_mcore.checkpointing import locate, megatron_lm

    folder = os.path.join(mlm_root, "iter_0000010")
    assert megatron_lm.is_megatron_lm(folder)
    for spec in (mlm_root, folder):
        assert locate.resolve(spec, None, "--resume") == (folder, [])
    data = os.path.join(folder, "__0_1.distcp")
    with open(data, "r+b") as fh:
        fh.truncate(os.path.getsize(data) // 2)
    with pytest.raises(CheckpointError) as info:
        locate.resolve(folder, None, "--resume")
    text = str(info.value)
    assert "Megatron-LM checkpoint whose __0_1.distcp has" in text and "truncated" in text
    assert "manifest" not in text


@pytest.mark.parametrize("command", ["resume", "finetune"])
def test_tampered_common_pt_runs_nothing(in_process, tmp_path, mlm_root, command):
    """common.pt's Namespace may hold only plain values: a planted callable is refused by
    name before it is built, whether the run resumes or finetunes."""
    import argparse

    folder = os.path.join(mlm_root, "iter_0000010")
    common = torch.load(os.path.join(folder, "common.pt"), weights_only=False)
    marker = tmp_path / "PLANTED_CODE_RAN"
    common["args"] = argparse.Namespace(**{**vars(common["args"]), "seed": T.Evil(str(marker))})
    torch.save(common, os.path.join(folder, "common.pt"))
    flags = ({"resume": mlm_root} if command == "resume"
             else {"load": folder, "finetune": True})
    with pytest.raises(CheckpointError) as info:
        in_process(output_dir=str(tmp_path / "out"), **flags)
    assert f"{folder}: common.pt: refusing to unpickle {os.system.__module__}.system" \
        in str(info.value)
    assert not marker.exists(), "the planted pickle ran"
