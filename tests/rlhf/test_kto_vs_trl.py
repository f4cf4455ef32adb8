"""KTO against TRL 1.16's KTOTrainer: for the same tiny model, reference and batch, the rows
and KL rows tokenized alike; the loss, the policy's gradients, the per-row rewards, the KL
estimate and the logged metrics of one step."""

import pytest
import torch

import hf_helpers as H
from rlhf_helpers import KTO_ROWS, run_flags

WEIGHTS = dict(desirable_weight=0.7, undesirable_weight=1.3)
ROWS = len(KTO_ROWS)


@pytest.fixture(scope="module")
def kto_data(tiny_hf, kto_file, tmp_path_factory):
    """(policy folder, reference folder, KTO jsonl): the reference another random model, so
    that rewards and KL are not 0."""
    reference = tmp_path_factory.mktemp("kto") / "ref"
    H.make_model(str(reference), "llama", seed=1, initializer_range=0.05)
    return tiny_hf[0], reference, kto_file


def our_trainer(kto_data, out, *flags):
    """Our KtoTrainer, set up, and one micro-batch of every row."""
    from swift_mcore.arguments import RlhfArguments, parse_args
    from swift_mcore.run_config import resolve
    from swift_mcore.training.kto_trainer import KtoTrainer

    folder, reference, data = kto_data
    argv = ["--model", str(folder), "--ref_model", str(reference), "--dataset", str(data),
            "--output_dir", str(out), "--train_iters", "1", "--no_save", "--rlhf_type", "kto",
            "--desirable_weight", str(WEIGHTS["desirable_weight"]),
            "--undesirable_weight", str(WEIGHTS["undesirable_weight"]), *flags,
            *run_flags("--micro_batch_size", str(ROWS), "--global_batch_size", str(ROWS))]
    config = resolve(parse_args(argv, prog="swift-mcore rlhf", cls=RlhfArguments),
                     world_size=1)
    trainer = KtoTrainer(config)
    trainer.setup()
    batch = trainer.train_ds.collate([trainer.train_ds[i] for i in range(ROWS)])
    return trainer, batch


def close(trainer, out):
    from swift_mcore.runtime import run_lock

    trainer.writer.close()
    trainer.watchdog.close()
    run_lock.release(str(out))


@pytest.fixture(scope="module")
def ours(kto_data, tmp_path_factory, gloo_group):
    out = tmp_path_factory.mktemp("ours")
    trainer, batch = our_trainer(kto_data, out)
    yield trainer, batch
    close(trainer, out)


def make_trl_trainer(kto_data, out, **config):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    folder, reference, _ = kto_data
    load = dict(dtype=torch.float32, attn_implementation="eager")
    args = KTOConfig(output_dir=str(out), report_to=[],
                     per_device_train_batch_size=ROWS, max_length=65, use_cpu=True,
                     bf16=False, gradient_checkpointing=False, **WEIGHTS, **config)
    return KTOTrainer(model=AutoModelForCausalLM.from_pretrained(str(folder), **load),
                      ref_model=AutoModelForCausalLM.from_pretrained(str(reference), **load),
                      args=args, train_dataset=Dataset.from_list(KTO_ROWS),
                      processing_class=AutoTokenizer.from_pretrained(str(folder)))


@pytest.fixture(scope="module")
def trl_trainer(kto_data, tmp_path_factory):
    return make_trl_trainer(kto_data, tmp_path_factory.mktemp("trl"))


def trl_inputs(trainer):
    return trainer.data_collator([trainer.train_dataset[i] for i in range(ROWS)])


def test_rows_and_kl_rows_are_tokenized_as_trl_tokenizes_them(ours, trl_trainer):
    _, batch = ours
    theirs = trl_inputs(trl_trainer)
    assert batch["desirable"].tolist() == [r["label"] for r in KTO_ROWS]
    for ours_prefix, their_prefix in (("", ""), ("kl_", "KL_")):
        ids = theirs[their_prefix + "input_ids"]
        for i in range(ROWS):
            n = int(theirs[their_prefix + "attention_mask"][i].sum())
            assert batch[ours_prefix + "tokens"][i, :n - 1].tolist() == ids[i, :n - 1].tolist()
            assert batch[ours_prefix + "labels"][i, :n - 1].tolist() == ids[i, 1:n].tolist()
            mask = batch[ours_prefix + "loss_mask"][i]
            assert mask.tolist()[:n - 1] == \
                theirs[their_prefix + "completion_mask"][i, 1:n].float().tolist()
            assert mask[n - 1:].sum() == 0
    # a KL row is the row's prompt with the previous row's completion
    assert batch["kl_tokens"][1].tolist() != batch["tokens"][1].tolist()


def test_loss_gradients_rewards_and_metrics_equal_trl(ours, trl_trainer):
    check_one_step(*ours, trl_trainer)


def test_apo_zero_unpaired_equals_trl(kto_data, tmp_path, gloo_group):
    """--loss_type apo_zero_unpaired: TRL's unpaired APO-zero loss (no KL rows, kl 0)."""
    trainer, batch = our_trainer(kto_data, tmp_path / "ours", "--loss_type",
                                 "apo_zero_unpaired")
    try:
        assert "kl_tokens" not in batch  # no KL rows are made or run
        theirs = make_trl_trainer(kto_data, tmp_path / "trl", loss_type="apo_zero_unpaired")
        check_one_step(trainer, batch, theirs)
    finally:
        close(trainer, tmp_path / "ours")


def check_one_step(trainer, batch, trl_trainer):
    from swift_mcore.models.convert import Layout

    for chunk in trainer.model:
        chunk.zero_grad_buffer()
    losses = trainer.forward_backward(iter([dict(batch)]), forward_only=False)
    loss_sum, rows, _ = trainer.reduce_losses(losses)
    metrics = trainer.preference_metrics(losses)
    grads = {name.removeprefix("module."): p.main_grad
             for name, p in trainer.model[0].named_parameters()}
    grad_of = Layout.from_model_args(trainer.config.model, trainer.config.padded_vocab_size)

    model = trl_trainer.model
    model.zero_grad()
    inputs = trl_inputs(trl_trainer)
    their_loss = trl_trainer.compute_loss(model, inputs)
    their_loss.backward()
    mode = "train" if model.training else "eval"
    theirs = {k: v[-1] for k, v in trl_trainer._metrics[mode].items()}

    assert loss_sum / rows == pytest.approx(their_loss.item(), abs=1e-5)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                 "logps/rejected", "kl"):
        assert metrics[name] == pytest.approx(theirs[name], abs=1e-5), name
    assert abs(metrics["rewards/margins"]) > 1e-3  # the reference differs from the policy
    scale = max(p.grad.abs().max().item() for p in model.parameters())
    assert scale > 0
    for name, p in model.named_parameters():
        mine = grad_of.to_hf(name, grads.__getitem__)
        assert (mine - p.grad).abs().max().item() <= 1e-5, name

    # per row: TRL's own log-probabilities of the policy and the reference
    policy, _ = trl_trainer.compute_ref_log_probs(model, inputs)
    reference, _ = trl_trainer.compute_ref_log_probs(trl_trainer.ref_model, inputs)
    their_rewards = trl_trainer.beta * (policy - reference)
    forward = trainer.forward_step(iter([dict(batch)]), trainer.model[0])
    with torch.no_grad():
        output, loss_of = forward
        our_batch = loss_of.args[0]
        logps = -(output.float() * our_batch["loss_mask"]).sum(1)
        out = trainer.kto(logps, our_batch["ref_logps"], our_batch["desirable"],
                          trainer.batch_kl(our_batch))
    assert (out["rewards"] - their_rewards).abs().max().item() <= 1e-5
    assert (logps - policy).abs().max().item() <= 1e-5


USER = {"role": "user", "content": "def add(a, b):"}
GOOD = {"role": "assistant", "content": "return a + b"}
BAD = {"role": "assistant", "content": "pass"}
TOOL = {"type": "function", "function": {"name": "add", "description": "adds",
                                         "parameters": {"type": "object", "properties": {}}}}
# (our row, the same data in TRL's form)
FORMATS = {
    "text": ({"prompt": "x = ", "completion": "1 + 2", "label": False},) * 2,
    "conversational": ({"prompt": [USER], "completion": [GOOD], "label": True},) * 2,
    "conversational_tools": ({"prompt": [USER], "completion": [BAD], "label": False,
                              "tools": [TOOL]},) * 2,
    "ms_swift": ({"messages": [USER, GOOD], "label": True},
                 {"prompt": [USER], "completion": [GOOD], "label": True}),
    "pair": ({"prompt": "x = ", "chosen": "1 + 2", "rejected": "add(1)"},) * 2,
    "ms_swift_pair": ({"messages": [USER, GOOD], "rejected_response": "pass"},
                      {"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]}),
}


@pytest.mark.parametrize("form", sorted(FORMATS))
def test_each_format_is_tokenized_as_trl_tokenizes_it(tiny_hf, trl_trainer, form):
    from datasets import Dataset
    from transformers import AutoTokenizer

    from swift_mcore.data.unpaired import to_unpaired, tokenize_unpaired
    from test_dpo_vs_trl import CHATML

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_hf[0]))
    tokenizer.chat_template = CHATML
    row, trl_row = FORMATS[form]
    mine = [(*tokenize_unpaired(u, tokenizer), u.desirable) for u in to_unpaired(row, "row 0")]
    args = trl_trainer.args
    saved, args.max_length = args.max_length, None  # TRL would drop a long prompt silently
    try:
        theirs = trl_trainer._prepare_dataset(Dataset.from_list([trl_row]), tokenizer, args,
                                              "test")
    finally:
        args.max_length = saved
    assert mine == [(t["prompt_ids"], t["completion_ids"], t["label"]) for t in theirs]
    assert all(completion for _, completion, _ in mine)
    if form == "conversational_tools":  # the tools reach the template
        plain = to_unpaired({**row, "tools": None}, "row 0")[0]
        assert tokenize_unpaired(plain, tokenizer)[0] != mine[0][0]


def test_the_kl_estimate_is_the_mismatched_rows_mean_clamped_at_zero(ours):
    trainer, _ = ours
    ref = torch.tensor([-5.0, -6.0, -7.0])
    above = {"kl_logps": ref + torch.tensor([0.5, 1.0, 1.5]), "ref_kl_logps": ref}
    below = {"kl_logps": ref - torch.tensor([0.5, 1.0, 1.5]), "ref_kl_logps": ref}
    assert trainer.batch_kl(above).item() == pytest.approx(1.0)
    assert trainer.batch_kl(below).item() == 0.0  # TRL's clamp(min=0)


def _dp2_rank(rank, port):
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state

    from swift_mcore.training.kto_trainer import KtoTrainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(1, 1)
    ref = torch.tensor([-5.0, -6.0])
    # this rank's mean log-ratio of the mismatched rows, and what both ranks must get: the
    # mean over the ranks, then the clamp (TRL's gather, mean, clamp)
    for mine, want in (([1.0, -0.2][rank], 0.4), ([2.0, -3.0][rank], 0.0)):
        batch = {"kl_logps": ref + mine, "ref_kl_logps": ref}
        got = KtoTrainer.batch_kl(None, batch).item()
        assert got == pytest.approx(want, abs=1e-6), (rank, mine, got)
    dist.destroy_process_group()


@pytest.mark.benchmark
def test_the_kl_estimate_is_averaged_over_data_parallel_ranks_before_the_clamp():
    import torch.multiprocessing as mp

    from run_helpers import free_port

    mp.spawn(_dp2_rank, args=(free_port(),), nprocs=2, join=True)
