"""The reward model (--rlhf_type rm) against transformers and TRL 1.16: its scores equal
*ForSequenceClassification's (Llama and Qwen2, tied embeddings), its loss and gradients of
one step TRL's RewardTrainer's (margins, --center_rewards_coefficient), its data tokenized
as TRL's; a reward model from a causal LM gets a head drawn from --seed alone."""

import json

import pytest
import torch

import hf_helpers as H
from reward_helpers import MARGIN_ROWS, hf_scores, make_score_model
from rlhf_helpers import ROWS, run_flags

CENTER = 0.01


def reward_trainer(folder, data, out, *extra):
    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.run_config import resolve
    from swift_mcore.training.reward_trainer import RewardTrainer

    argv = ["--rlhf_type", "rm", "--model", str(folder), "--dataset", str(data),
            "--output_dir", str(out), "--train_iters", "1", "--no_save", *run_flags(*extra)]
    trainer = RewardTrainer(resolve(parse_args(argv, prog="swift-mcore rlhf",
                                               cls=RlhfArguments), world_size=1))
    trainer.setup()
    return trainer


def close(trainer):
    from swift_mcore.runtime import run_lock

    trainer.writer.close()
    trainer.watchdog.close()
    run_lock.release(trainer.config.logging.output_dir)


def whole_batch(trainer):
    return trainer.train_ds.collate([trainer.train_ds[i] for i in range(len(ROWS))])


def sequences(trainer):
    items = [trainer.train_ds[i] for i in range(len(trainer.train_ds))]
    return [i["chosen"].tolist() for i in items] + [i["rejected"].tolist() for i in items]


@pytest.fixture(scope="module")
def score_folder(tmp_path_factory):
    """(Llama *ForSequenceClassification folder, pairs with margins)."""
    root = tmp_path_factory.mktemp("rm")
    make_score_model(root / "hf")
    data = root / "prefs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in MARGIN_ROWS))
    return root / "hf", data


@pytest.fixture(scope="module")
def ours(score_folder, tmp_path_factory, gloo_group):
    trainer = reward_trainer(*score_folder, tmp_path_factory.mktemp("ours"),
                             "--center_rewards_coefficient", str(CENTER))
    yield trainer
    close(trainer)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_scores_equal_transformers_sequence_classification(family, tmp_path, gloo_group):
    """Qwen2's tiny config ties its embeddings: the score head is no LM head all the same."""
    folder = tmp_path / "hf"
    make_score_model(folder, family)
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    trainer = reward_trainer(folder, data, tmp_path / "out")
    try:
        batch = whole_batch(trainer)
        with torch.no_grad():
            output = trainer.model[0](input_ids=batch["tokens"],
                                      position_ids=batch["position_ids"], attention_mask=None)
        mine = trainer.rewards(batch, output)
    finally:
        close(trainer)
    theirs = hf_scores(folder, sequences(trainer))
    assert theirs.abs().max() > 1e-3  # a head of zeros would agree with anything
    assert (mine - theirs).abs().max().item() <= 1e-5


@pytest.fixture(scope="module")
def trl_trainer(score_folder, tmp_path_factory):
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    folder, _ = score_folder
    model = AutoModelForSequenceClassification.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager")
    args = RewardConfig(output_dir=str(tmp_path_factory.mktemp("trl")), report_to=[],
                        per_device_train_batch_size=len(ROWS), max_length=64, use_cpu=True,
                        bf16=False, center_rewards_coefficient=CENTER,
                        gradient_checkpointing=False)
    return RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(MARGIN_ROWS),
                         processing_class=AutoTokenizer.from_pretrained(str(folder)))


def test_pairs_are_tokenized_as_trl_tokenizes_them(ours, trl_trainer):
    theirs = [trl_trainer.train_dataset[i] for i in range(len(ROWS))]
    for i, row in enumerate(theirs):
        item = ours.train_ds[i]
        assert item["chosen"].tolist() == row["chosen_ids"]
        assert item["rejected"].tolist() == row["rejected_ids"]
        assert item["margin"] == row["margin"] == MARGIN_ROWS[i]["margin"]


def test_loss_and_gradients_equal_trl(ours, trl_trainer):
    from swift_mcore.models.convert import Layout

    for chunk in ours.model:
        chunk.zero_grad_buffer()
    losses = ours.forward_backward(iter([whole_batch(ours)]), forward_only=False)
    loss_sum, pairs, _ = ours.reduce_losses(losses)
    metrics = ours.preference_metrics(losses)
    grads = {n.removeprefix("module."): p.main_grad for n, p in ours.model[0].named_parameters()}
    layout = Layout.from_model_args(ours.config.model, ours.config.padded_vocab_size)

    model = trl_trainer.model
    model.train()  # TRL files the metrics of a model in training mode under "train"
    model.zero_grad()
    inputs = trl_trainer.data_collator([trl_trainer.train_dataset[i] for i in range(len(ROWS))])
    assert "margin" in inputs
    trl_trainer._metrics["train"].clear()
    loss = trl_trainer.compute_loss(model, inputs)
    loss.backward()
    assert loss_sum / pairs == pytest.approx(loss.item(), abs=1e-5)
    logged = {k: v[-1] for k, v in trl_trainer._metrics["train"].items()}
    for name in ("accuracy", "margin", "mean_reward", "min_reward", "max_reward"):
        assert metrics[name] == pytest.approx(logged[name], abs=1e-5), name
    assert metrics["rewards/margins"] == pytest.approx(logged["margin"], abs=1e-5)
    assert metrics["rewards/accuracies"] == pytest.approx(logged["accuracy"], abs=1e-5)
    assert metrics["rewards/chosen"] - metrics["rewards/rejected"] == \
        pytest.approx(logged["margin"], abs=1e-5)
    theirs = {n: p.grad for n, p in model.named_parameters()}
    assert theirs["score.weight"].abs().max() > 0
    for name, grad in theirs.items():
        mine = layout.to_hf(name, grads.__getitem__)
        assert (mine - grad).abs().max().item() <= 1e-5, name


def test_a_causal_lm_gets_a_new_head_drawn_from_the_seed(tiny_hf, tmp_path, gloo_group):
    """The body is --model's; the head normal(0, --init_method_std) from --seed alone."""
    from swift_mcore.models.convert import Layout

    folder, data = tiny_hf
    heads = []
    for name, seed in (("a", "42"), ("b", "42"), ("c", "7")):
        trainer = reward_trainer(folder, data, tmp_path / name, "--seed", seed)
        model = trainer.model[0]
        state = {k.removeprefix("module."): v for k, v in model.state_dict().items()}
        heads.append(state["output_layer.weight"].clone())
        layout = Layout.from_model_args(trainer.config.model, trainer.config.padded_vocab_size)
        std = trainer.config.model.init_method_std
        close(trainer)
    assert heads[0].shape == (1, 64)
    assert torch.equal(heads[0], heads[1]) and not torch.equal(heads[0], heads[2])
    generator = torch.Generator().manual_seed(42)
    assert torch.equal(heads[0], torch.empty(1, 64).normal_(0.0, std, generator=generator))
    body = H.safetensors_state(str(folder))
    assert "score.weight" in dict(layout.hf_tensors())
    for name in body:
        if name != "lm_head.weight":
            assert torch.equal(layout.to_hf(name, state.__getitem__), body[name]), name
