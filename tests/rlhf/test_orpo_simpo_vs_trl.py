"""ORPO and SimPO against TRL 1.16's ORPOTrainer and CPOTrainer (loss_type "simpo"): for the
same tiny model and batch, the pairs tokenized alike; the loss, the policy's gradients and
the logged metrics of one step."""

import pytest
import torch

from rlhf_helpers import ROWS, run_flags

BETA = 0.3
# (task, our flags, TRL's trainer, its config's arguments)
TASKS = {
    "orpo": ([], "ORPO", {}),
    "simpo": (["--simpo_gamma", "0.7", "--label_smoothing", "0.1"], "CPO",
              dict(loss_type="simpo", simpo_gamma=0.7, label_smoothing=0.1, cpo_alpha=0.0)),
    "simpo_cpo_alpha": (["--simpo_gamma", "0.7", "--cpo_alpha", "0.5"], "CPO",
                        dict(loss_type="simpo", simpo_gamma=0.7, cpo_alpha=0.5)),
}
ORPO_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
              "logps/chosen", "logps/rejected", "nll_loss", "log_odds_ratio",
              "log_odds_chosen")


def _ours(task, tiny_hf, out):
    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.cli import trainer_class
    from swift_mcore.run_config import resolve

    folder, data = tiny_hf
    flags, _, _ = TASKS[task]
    argv = ["--model", str(folder), "--dataset", str(data), "--output_dir", str(out),
            "--train_iters", "1", "--no_save", "--rlhf_type", task.split("_")[0],
            "--beta", str(BETA), *flags, *run_flags()]
    config = resolve(parse_args(argv, prog="swift-mcore rlhf", cls=RlhfArguments),
                     world_size=1)
    trainer = trainer_class(config)(config)
    trainer.setup()
    assert trainer.reference is None
    return trainer


def _trl(task, tiny_hf, out):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    folder, _ = tiny_hf
    _, which, extra = TASKS[task]
    config, trainer = (ORPOConfig, ORPOTrainer) if which == "ORPO" else (CPOConfig, CPOTrainer)
    args = config(output_dir=str(out), report_to=[], per_device_train_batch_size=len(ROWS),
                  max_length=65, use_cpu=True, bf16=False, gradient_checkpointing=False,
                  beta=BETA, **extra)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                 attn_implementation="eager")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.pad_token = tokenizer.eos_token  # the collator pads; padding is masked out
    return trainer(model=model, args=args, train_dataset=Dataset.from_list(ROWS),
                   processing_class=tokenizer)


@pytest.fixture(scope="module")
def pair(tiny_hf, tmp_path_factory, gloo_group, request):
    from swift_mcore.runtime import run_lock

    task = request.param
    out = tmp_path_factory.mktemp("ours")
    ours = _ours(task, tiny_hf, out)
    yield task, ours, _trl(task, tiny_hf, tmp_path_factory.mktemp("trl"))
    ours.writer.close()
    ours.watchdog.close()
    run_lock.release(str(out))


@pytest.fixture(scope="module")
def pair_orpo(tiny_hf, tmp_path_factory):
    """TRL's ORPOTrainer alone (its tokenize_row)."""
    return _trl("orpo", tiny_hf, tmp_path_factory.mktemp("trl_orpo"))


def _their_batch(trainer):
    return trainer.data_collator([trainer.train_dataset[i] for i in range(len(ROWS))])


@pytest.mark.parametrize("pair", sorted(TASKS), indirect=True)
def test_pairs_are_tokenized_as_trl_tokenizes_them(pair):
    _, ours, theirs = pair
    batch = ours.train_ds.collate([ours.train_ds[i] for i in range(len(ROWS))])
    inputs = _their_batch(theirs)
    for half, answer in enumerate(("chosen", "rejected")):
        ids, labels = inputs[answer + "_input_ids"], inputs[answer + "_labels"]
        for i in range(len(ROWS)):
            row = half * len(ROWS) + i
            n = int(inputs[answer + "_attention_mask"][i].sum())
            assert batch["tokens"][row, :n - 1].tolist() == ids[i, :n - 1].tolist()
            assert batch["labels"][row, :n - 1].tolist() == ids[i, 1:n].tolist()
            assert batch["loss_mask"][row].tolist()[:n - 1] == \
                (labels[i, 1:n] != -100).float().tolist()
            assert batch["sequence_mask"][row].sum() == n - 1


@pytest.mark.parametrize("pair", sorted(TASKS), indirect=True)
def test_loss_gradients_and_metrics_equal_trl(pair):
    from swift_mcore.models.convert import Layout

    task, ours, theirs = pair
    batch = ours.train_ds.collate([ours.train_ds[i] for i in range(len(ROWS))])
    for chunk in ours.model:
        chunk.zero_grad_buffer()
    losses = ours.forward_backward(iter([dict(batch)]), forward_only=False)
    loss_sum, pairs, _ = ours.reduce_losses(losses)
    metrics = ours.preference_metrics(losses)
    grads = {name.removeprefix("module."): p.main_grad
             for name, p in ours.model[0].named_parameters()}
    layout = Layout.from_model_args(ours.config.model, ours.config.padded_vocab_size)

    model = theirs.model
    model.zero_grad()
    loss = theirs.compute_loss(model, _their_batch(theirs))
    loss.backward()
    logged = {k: v[-1] for k, v in theirs._stored_metrics["train"].items()}

    assert loss_sum / pairs == pytest.approx(loss.item(), abs=1e-5)
    names = ORPO_NAMES if task == "orpo" else ORPO_NAMES[:7]
    assert tuple(ours.METRIC_NAMES) == names
    for name in names:
        assert metrics[name] == pytest.approx(logged[name], abs=1e-5), name
    if task == "simpo":
        assert metrics["nll_loss"] == 0.0  # TRL reports 0 without cpo_alpha
    else:
        assert metrics["nll_loss"] > 1.0
    assert max(p.grad.abs().max().item() for p in model.parameters()) > 0
    for name, p in model.named_parameters():
        mine = layout.to_hf(name, grads.__getitem__)
        assert (mine - p.grad).abs().max().item() <= 1e-5, name


def test_log1mexp_is_finite_with_finite_gradients_near_zero_and_far_below():
    from swift_mcore.training.reference_free_loss import log1mexp

    x = torch.tensor([-1e-7, -0.1, -0.69, -0.7, -5.0, -80.0], dtype=torch.float64,
                     requires_grad=True)
    y = log1mexp(x)
    y.sum().backward()
    want = torch.log(1 - torch.exp(x.detach()))
    assert torch.allclose(y.detach(), want, rtol=1e-6)
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("form", ["conversational", "ms_swift", "implicit_conversational"])
def test_conversations_are_tokenized_as_trl_orpo_tokenizes_them(pair_orpo, form):
    """A conversation rendered by the chat template, then tokenized as text rows (TRL's
    maybe_extract_prompt, maybe_apply_chat_template and tokenize_row)."""
    from transformers import AutoTokenizer

    from swift_mcore.data.preference import to_pair, tokenize_pair_per_answer
    from test_dpo_vs_trl import CHATML, FORMATS
    from trl.data_utils import maybe_apply_chat_template, maybe_extract_prompt

    row, trl_row = FORMATS[form]
    theirs = pair_orpo
    tokenizer = AutoTokenizer.from_pretrained(theirs.processing_class.name_or_path)
    tokenizer.chat_template = CHATML
    prompt, chosen, rejected, chosen_head, rejected_head = tokenize_pair_per_answer(
        to_pair(row, "row 0"), tokenizer)
    saved = theirs.processing_class, theirs.max_length
    # no cut: the rendered conversation is longer than the text rows' max_length
    theirs.processing_class, theirs.max_length = tokenizer, 1000
    try:
        text = maybe_apply_chat_template(maybe_extract_prompt(dict(trl_row)), tokenizer)
        tokens = theirs.tokenize_row(text)
    finally:
        theirs.processing_class, theirs.max_length = saved
    assert prompt + chosen == tokens["chosen_input_ids"]
    assert prompt + rejected == tokens["rejected_input_ids"]
    for ids, head, key in ((chosen, chosen_head, "chosen_labels"),
                           (rejected, rejected_head, "rejected_labels")):
        labels = tokens[key]
        assert [t != -100 for t in labels] == [False] * (len(prompt) + head) + \
            [True] * (len(ids) - head)
