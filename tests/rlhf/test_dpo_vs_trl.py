"""DPO against TRL 1.16's DPOTrainer: for the same tiny model, reference and batch, the
loss and the policy's gradients of one step, per loss type; the data tokenized alike."""

import pytest
import torch

from rlhf_helpers import ROWS, run_flags

LOSS_TYPES = ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair",
              "sppo_hard", "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft",
              "sigmoid_norm"]


def our_trainer(tiny_hf, out, *flags):
    """Our DpoTrainer, set up on tiny_hf, and one batch of all four pairs."""
    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.run_config import resolve
    from swift_mcore.training.rlhf_trainer import DpoTrainer

    folder, data = tiny_hf
    argv = ["--model", str(folder), "--dataset", str(data), "--output_dir", str(out),
            "--train_iters", "1", "--no_save", *flags, *run_flags()]
    config = resolve(parse_args(argv, prog="swift-mcore rlhf", cls=RlhfArguments),
                     world_size=1)
    trainer = DpoTrainer(config)
    trainer.setup()
    batch = trainer.train_ds.collate([trainer.train_ds[i] for i in range(len(ROWS))])
    yield trainer, batch
    trainer.writer.close()
    trainer.watchdog.close()
    from swift_mcore.runtime import run_lock

    run_lock.release(str(out))


@pytest.fixture(scope="module")
def ours(tiny_hf, tmp_path_factory, gloo_group):
    """Ours with the reference a frozen copy of the policy."""
    yield from our_trainer(tiny_hf, tmp_path_factory.mktemp("ours"))


@pytest.fixture(scope="module")
def other_reference(tiny_hf):
    """A reference of tiny_hf's shape with other weights: the policy's log-ratios are not
    0, where a loss written wrongly may still agree with TRL's at 0."""
    import hf_helpers as H

    folder = tiny_hf[0].parent / "other_reference"
    if not folder.exists():
        H.make_model(str(folder), "llama", seed=1, initializer_range=0.02)
    return folder


@pytest.fixture(scope="module")
def ours_other(tiny_hf, other_reference, tmp_path_factory, gloo_group):
    yield from our_trainer(tiny_hf, tmp_path_factory.mktemp("ours_other"), "--ref_model",
                           str(other_reference))


@pytest.fixture(scope="module")
def trl_trainer(tiny_hf, tmp_path_factory):
    return make_trl_trainer(tiny_hf, tiny_hf[0], tmp_path_factory)


@pytest.fixture(scope="module")
def trl_other(tiny_hf, other_reference, tmp_path_factory):
    return make_trl_trainer(tiny_hf, other_reference, tmp_path_factory)


def make_trl_trainer(tiny_hf, reference_folder, tmp_path_factory):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    folder, _ = tiny_hf
    load = dict(dtype=torch.float32, attn_implementation="eager")
    policy = AutoModelForCausalLM.from_pretrained(str(folder), **load)
    reference = AutoModelForCausalLM.from_pretrained(str(reference_folder), **load)
    args = DPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), report_to=[],
                     per_device_train_batch_size=len(ROWS), max_length=65, use_cpu=True,
                     bf16=False, label_smoothing=0.1, gradient_checkpointing=False)
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args,
                         train_dataset=Dataset.from_list(ROWS),
                         processing_class=AutoTokenizer.from_pretrained(str(folder)))
    return trainer


def trl_step(trainer, loss_type):
    """TRL's loss and the policy's gradients (by HF parameter name) for all pairs at once."""
    trainer.loss_types, trainer.loss_weights = [loss_type], [1.0]
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(ROWS))])
    model = trainer.model
    model.zero_grad()
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def our_step(trainer, batch, loss_type):
    import dataclasses

    from swift_mcore.models.convert import Layout

    trainer.dpo = dataclasses.replace(trainer.dpo, loss_types=(loss_type,), loss_weights=(1.0,),
                                      label_smoothing=0.1)
    for chunk in trainer.model:
        chunk.zero_grad_buffer()
    losses = trainer.forward_backward(iter([dict(batch)]), forward_only=False)
    loss_sum, pairs, _ = trainer.reduce_losses(losses)
    grads = {name.removeprefix("module."): p.main_grad
             for name, p in trainer.model[0].named_parameters()}
    layout = Layout.from_model_args(trainer.config.model, trainer.config.padded_vocab_size)
    return loss_sum / pairs, lambda hf_name: layout.to_hf(hf_name, grads.__getitem__)


def test_pairs_are_tokenized_as_trl_tokenizes_them(ours, trl_trainer):
    trainer, batch = ours
    theirs = trl_trainer.data_collator([trl_trainer.train_dataset[i]
                                        for i in range(len(ROWS))])
    for i in range(2 * len(ROWS)):
        n = int(theirs["attention_mask"][i].sum())
        assert batch["tokens"][i, :n - 1].tolist() == theirs["input_ids"][i, :n - 1].tolist()
        assert batch["labels"][i, :n - 1].tolist() == theirs["input_ids"][i, 1:n].tolist()
        assert batch["loss_mask"][i].tolist()[:n - 1] == \
            theirs["completion_mask"][i, 1:n].float().tolist()
        assert batch["loss_mask"][i, n - 1:].sum() == 0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_gradients_equal_trl(ours, trl_trainer, loss_type):
    assert_step_equals_trl(ours, trl_trainer, loss_type)


@pytest.mark.benchmark
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_gradients_equal_trl_against_another_reference(ours_other, trl_other,
                                                                loss_type):
    """With a reference unlike the policy every log-ratio is away from 0 (at 0 sigmoid and
    sigmoid_norm, aot and aot_unpaired, ... take the same values)."""
    assert_step_equals_trl(ours_other, trl_other, loss_type)


def assert_step_equals_trl(ours, trl_trainer, loss_type):
    trainer, batch = ours
    loss, grad_of = our_step(trainer, batch, loss_type)
    their_loss, their_grads = trl_step(trl_trainer, loss_type)
    # relative past 1 (sppo_hard's and ipo's squares reach 50 with another reference)
    assert loss == pytest.approx(their_loss, abs=1e-5, rel=1e-6)
    scale = max(g.abs().max().item() for g in their_grads.values())
    assert scale > 0
    for name, theirs in their_grads.items():
        mine = grad_of(name)
        assert (mine - theirs).abs().max().item() <= 1e-5 * max(1.0, scale), name


CHATML = ("{% if tools %}<|im_start|>system\ntools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
          "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
USER = {"role": "user", "content": "def add(a, b):"}
GOOD = {"role": "assistant", "content": "return a + b"}
BAD = {"role": "assistant", "content": "pass"}
TOOL = {"type": "function", "function": {"name": "add", "description": "adds",
                                         "parameters": {"type": "object", "properties": {}}}}
# (our row, the same pair in TRL's form)
FORMATS = {
    "conversational": ({"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]},) * 2,
    "conversational_tools": ({"prompt": [USER], "chosen": [GOOD], "rejected": [BAD],
                              "tools": [TOOL]},) * 2,
    "implicit_conversational": ({"chosen": [USER, GOOD], "rejected": [USER, BAD]},) * 2,
    "implicit_text": ({"chosen": "def add(a, b): return a + b",
                       "rejected": "def add(a, b): pass"},) * 2,
    "ms_swift": ({"messages": [USER, GOOD], "rejected_response": "pass"},
                 {"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]}),
}


@pytest.mark.parametrize("form", sorted(FORMATS))
def test_each_format_is_tokenized_as_trl_tokenizes_it(tiny_hf, trl_trainer, form):
    from datasets import Dataset
    from transformers import AutoTokenizer

    from swift_mcore.data.preference import to_pair, tokenize_pair

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_hf[0]))
    tokenizer.chat_template = CHATML
    row, trl_row = FORMATS[form]
    prompt, chosen, rejected = tokenize_pair(to_pair(row, "row 0"), tokenizer)
    args = trl_trainer.args
    saved, args.max_length = args.max_length, None  # TRL would drop a long prompt silently
    try:
        theirs = trl_trainer._prepare_dataset(Dataset.from_list([trl_row]), tokenizer, args,
                                              "test")[0]
    finally:
        args.max_length = saved
    assert (prompt, chosen, rejected) == (theirs["prompt_ids"], theirs["chosen_ids"],
                                          theirs["rejected_ids"])
    assert chosen and rejected
    if form == "conversational_tools":  # the tools reach the template
        plain = tokenize_pair(to_pair(FORMATS["conversational"][0], "row 0"), tokenizer)
        assert plain[0] != prompt


def test_discopop_stays_finite_far_below_the_reference():
    """TRL's discopop multiplies exp(-logits), inf in float32 below logits -88, by a mixing
    weight that is 0 there: nan (loss and gradient) where the loss is finite. Ours equals the
    formula, evaluated in float64, where that is finite, and stays finite past it."""
    import torch.nn.functional as F

    from swift_mcore.training.dpo_loss import DpoLoss

    beta, tau = 0.5, 0.05
    loss_fn = DpoLoss(("discopop",), (1.0,), beta=beta, discopop_tau=tau)

    def formula(delta):  # DiscoPOP's Eq. (5), as TRL 1.16 writes it
        logits = beta * delta
        mix = torch.sigmoid(logits / tau)
        return -F.logsigmoid(logits) * (1 - mix) + torch.exp(-logits) * mix

    chosen = torch.tensor([-400.0, -60.0, -3.0, 0.0, 2.5, 40.0], requires_grad=True)
    zero = torch.zeros_like(chosen)
    ones = torch.ones_like(chosen)
    loss = loss_fn(chosen, zero, zero, zero, ones, ones, ones[:1])["loss"]
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(chosen.grad).all()
    wide = chosen.detach().double().requires_grad_()
    expected = formula(wide)
    expected.sum().backward()
    assert torch.allclose(loss.double(), expected, rtol=1e-6, atol=1e-6)
    assert torch.allclose(chosen.grad.double(), wide.grad, rtol=1e-5, atol=1e-6)
    # float32 as TRL computes it: nan at -400 (logits -200), where the loss is 200
    assert torch.isnan(formula(chosen.detach()[:1])).all()
    assert loss[0].item() == pytest.approx(200.0)
