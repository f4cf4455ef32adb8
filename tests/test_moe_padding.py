"""Padding left out of MoE routing statistics: rows padded to a longer length give the unpadded
rows' router losses and expert-bias token counts (training/moe_padding.py, the data's
``padding_mask``, and runtime/mcore_adaptation.py's fix of megatron's count)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from swift_mcore.arguments import parse_args
from swift_mcore.data.sequence_rows import lay_out
from swift_mcore.run_config import resolve
from swift_mcore.training.moe_padding import routing_padding

LENGTH, PADDED, VOCAB = 10, 16, 256


MOE = ["--num_experts", "4", "--moe_router_topk", "2", "--moe_router_score_function",
       "sigmoid", "--moe_router_enable_expert_bias", "--moe_aux_loss_coeff", "0.01",
       "--moe_z_loss_coeff", "0.001"]

# padded sft rows: one turn of 1 to 9 of these words a message
WORDS = "alpha beta gamma delta river stone cloud paper orange silver seven north".split()


def moe_config(moe=True):
    return resolve(parse_args([
        "--num_layers", "2", "--hidden_size", "32", "--num_attention_heads", "4",
        "--seq_length", str(PADDED), "--micro_batch_size", "2", "--global_batch_size", "2",
        *(MOE if moe else [])]), world_size=1, cuda=False).complete(VOCAB, None)


@pytest.fixture(scope="module")
def moe(gloo_group):
    from swift_mcore.models.gpt import build_model
    from swift_mcore.runtime.seed import set_seed

    config = moe_config()
    set_seed(1)
    return config, build_model(config)[0]


def sequences():
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, LENGTH + 1) for _ in range(2)]  # + 1: the shifted label


def routed(config, model, batch):
    """(router losses per layer, tokens per expert per layer, LM losses of the real
    positions, router weight gradients) of one training forward and backward."""
    from megatron.core.transformer.moe import moe_utils

    moe_utils.clear_aux_losses_tracker()
    routers = [layer.mlp.router for layer in model.decoder.layers]
    for router in routers:
        router.local_tokens_per_expert.zero_()
    model.zero_grad()
    losses = model(input_ids=batch["tokens"], position_ids=batch["position_ids"],
                   attention_mask=None, labels=batch["labels"],
                   **routing_padding(config, model, batch))
    (losses * batch["loss_mask"]).sum().backward()
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    stats = {name: entry["values"].clone() for name, entry in tracker.items()}
    moe_utils.clear_aux_losses_tracker()
    return (stats, [r.local_tokens_per_expert.clone() for r in routers],
            losses.detach()[:, :LENGTH], [r.weight.grad.clone() for r in routers])


def test_padded_rows_route_as_the_unpadded_rows(moe):
    """The same two rows, alone and padded from 10 to 16 positions: equal load-balancing
    loss, z-loss, router gradients and tokens per expert (hence the same expert-bias update),
    and the same LM loss."""
    config, model = moe
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    model.train()
    plain, _ = lay_out(sequences(), pad_id=0, masks=[np.ones(LENGTH + 1)] * 2)
    padded, _ = lay_out(sequences(), pad_id=0, masks=[np.ones(LENGTH + 1)] * 2, pad_to=PADDED)
    assert not plain["padding_mask"].any() and padded["padding_mask"].sum() == 2 * 6
    stats, counts, lm, grads = routed(config, model, plain)
    stats_p, counts_p, lm_p, grads_p = routed(config, model, padded)
    assert set(stats) == set(stats_p) == {"load_balancing_loss", "z_loss"}
    for name in stats:
        torch.testing.assert_close(stats_p[name], stats[name], rtol=0, atol=1e-6)
    assert [c.tolist() for c in counts] == [c.tolist() for c in counts_p]
    assert all(c.sum() == 2 * LENGTH * 2 for c in counts)  # topk 2 of 20 real tokens
    bias = model.decoder.layers[0].mlp.router.expert_bias
    torch.testing.assert_close(get_updated_expert_bias(counts_p[0], bias, 1e-3),
                               get_updated_expert_bias(counts[0], bias, 1e-3), rtol=0, atol=0)
    torch.testing.assert_close(lm_p, lm, rtol=0, atol=1e-6)
    for g, g_p in zip(grads, grads_p):
        torch.testing.assert_close(g_p, g, rtol=0, atol=1e-6)


def test_padded_rows_route_as_the_unpadded_rows_in_the_mtp_layer(gloo_group):
    """A DeepSeek-V3-style model (sigmoid routing with the expert bias) with one MoE MTP
    layer: the same two rows alone and padded (with a pad id other than the zero megatron
    fills rolled places with) give equal router losses, tokens per expert and router
    gradients in every layer, the MTP layer's included, which routes each row's positions
    but its last (whose next token lies past the row)."""
    from swift_mcore.models.gpt import build_model
    from swift_mcore.runtime import mcore_adaptation
    from swift_mcore.runtime.seed import set_seed

    config = resolve(parse_args([
        "--num_layers", "1", "--hidden_size", "32", "--num_attention_heads", "4",
        "--seq_length", str(PADDED), "--micro_batch_size", "2", "--global_batch_size", "2",
        "--mtp_num_layers", "1", *MOE]), world_size=1, cuda=False).complete(VOCAB, None)
    mcore_adaptation.pass_padding_mask_to_mtp_layers()  # as runtime/distributed does for it
    set_seed(1)
    model = build_model(config)[0]
    model.train()
    routers = [model.decoder.layers[0].mlp.router,
               model.mtp.layers[0].transformer_layer.mlp.router]
    masks = [np.ones(LENGTH + 1)] * 2

    def routed(batch):
        from megatron.core.transformer.moe import moe_utils

        moe_utils.clear_aux_losses_tracker()
        for router in routers:
            router.local_tokens_per_expert.zero_()
        model.zero_grad()
        losses = model(input_ids=batch["tokens"], position_ids=batch["position_ids"],
                       attention_mask=None, labels=batch["labels"],
                       loss_mask=batch["loss_mask"], **routing_padding(config, model, batch))
        (losses * batch["loss_mask"]).sum().backward()
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        stats = {name: entry["values"].clone() for name, entry in tracker.items()}
        moe_utils.clear_aux_losses_tracker()
        return (stats, [r.local_tokens_per_expert.clone() for r in routers],
                [r.weight.grad.clone() for r in routers])

    plain, _ = lay_out(sequences(), pad_id=7, masks=masks)
    padded, _ = lay_out(sequences(), pad_id=7, masks=masks, pad_to=PADDED)
    stats, counts, grads = routed(plain)
    stats_p, counts_p, grads_p = routed(padded)
    assert counts[0].sum() == 2 * LENGTH * 2 and counts[1].sum() == 2 * (LENGTH - 1) * 2
    assert [c.tolist() for c in counts_p] == [c.tolist() for c in counts]
    assert set(stats) == set(stats_p) == {"load_balancing_loss", "z_loss"}
    for name in stats:
        assert stats[name][1] > 0  # the MTP layer's
        torch.testing.assert_close(stats_p[name], stats[name], rtol=0, atol=1e-6)
    for g, g_p in zip(grads, grads_p):
        torch.testing.assert_close(g_p, g, rtol=0, atol=1e-6)


def test_a_dense_model_gets_no_mask():
    batch = {"padding_mask": torch.ones(2, 4, dtype=torch.bool)}
    assert routing_padding(moe_config(moe=False), object(), batch) == {}
    assert routing_padding(moe_config(), object(), {}) == {}  # data that does not pad


class Recorder(torch.nn.Module):
    """A model chunk that records what the forward step hands it."""

    pre_process = post_process = True

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(sequence_parallel=False)
        self.calls = []

    def forward(self, **kwargs):
        self.calls.append(kwargs)
        return torch.zeros(kwargs["input_ids"].shape)


def pair_batch():
    seqs = [np.arange(5), np.arange(3), np.arange(4), np.arange(6)]
    batch, _ = lay_out(seqs, pad_id=0, masks=[np.ones(len(s)) for s in seqs])
    return {**batch, "pair_index": torch.tensor([0, 1]), "margin": torch.zeros(2),
            "desirable": torch.ones(4),
            "attention_mask": None}


@pytest.mark.parametrize("trainer", ["Trainer", "DpoTrainer", "RewardTrainer",
                                     "ReferenceFreeTrainer", "KtoTrainer"])
@pytest.mark.parametrize("moe", [True, False])
def test_forward_steps_hand_the_policy_the_mask(gloo_group, trainer, moe):
    """Every trainer's forward step hands an MoE policy its batch's padding mask (and a
    dense one nothing); references and KTO's KL rows run without autograd, which the
    routers skip, and get none."""
    from swift_mcore.training import (kto_trainer, reference_free_trainer, reward_trainer,
                                      rlhf_trainer, trainer as plain)

    cls = {"Trainer": plain.Trainer, "DpoTrainer": rlhf_trainer.DpoTrainer,
           "RewardTrainer": reward_trainer.RewardTrainer,
           "ReferenceFreeTrainer": reference_free_trainer.ReferenceFreeTrainer,
           "KtoTrainer": kto_trainer.KtoTrainer}[trainer]
    config = moe_config(moe)
    batch = pair_batch()
    model, reference = Recorder(), Recorder()

    class Reference:
        def __enter__(self):
            return reference

        def __exit__(self, *exc):
            return False

    stub = SimpleNamespace(config=config, get_batch=lambda it: batch,
                           micro_batch=lambda it: batch, ref_table=torch.zeros(2, 2),
                           compute_loss=print, kto=SimpleNamespace(uses_kl=False),
                           reference_of=lambda chunk: Reference())
    cls.forward_step(stub, None, model)
    (call,) = model.calls
    if not moe:
        assert "padding_mask" not in call
    else:
        assert call["padding_mask"] is batch["padding_mask"]
    assert all("padding_mask" not in c for c in reference.calls)


@pytest.mark.parametrize("first_stage, vision, split", [
    (True, False, False), (False, False, True), (True, True, True)])
def test_sequence_parallel_splits_the_mask_where_megatron_does_not(monkeypatch, first_stage,
                                                                   vision, split):
    """megatron's GPTModel splits the mask over the sequence-parallel ranks only where it
    embeds the tokens itself: a later pipeline stage, or a vision-language model that hands
    in its own embedding, gets it split here (as megatron splits it: sequence first)."""
    from megatron.core import tensor_parallel

    def first_half(tensor):  # this rank's part of the sequence
        return tensor[:tensor.shape[0] // 2]

    monkeypatch.setattr(tensor_parallel, "scatter_to_sequence_parallel_region", first_half)
    config = SimpleNamespace(model=SimpleNamespace(num_experts=4,
                                                   vision_config={"depth": 1} if vision else None))
    inner = Recorder()
    inner.pre_process, inner.config.sequence_parallel = first_stage, True
    mask = torch.tensor([[False, False, False, True], [False, True, True, True]])
    got = routing_padding(config, SimpleNamespace(module=inner), {"padding_mask": mask})
    assert torch.equal(got["padding_mask"], mask[:, :2] if split else mask)


def test_the_data_marks_padding():
    """sft rows, rlhf rows (padded and packed) and reward rows mark their padding; a
    context-parallel rank gets its chunks of the mask with its tokens."""
    from swift_mcore.data.reward_pairs import RewardPairs
    from swift_mcore.data.sft_datasets import SftDataset
    from swift_mcore.training.trainer import on_this_cp_rank

    seqs = [np.arange(1, 6), np.arange(1, 4), np.arange(1, 8)]
    padded, _ = lay_out(seqs, pad_id=0, masks=[np.ones(len(s)) for s in seqs], pad_multiple=4)
    assert padded["tokens"].shape == (3, 8)
    assert torch.equal(padded["padding_mask"], padded["sequence_mask"] == 0)
    packed, _ = lay_out(seqs, pad_id=0, masks=[np.ones(len(s)) for s in seqs], pack_to=8)
    assert torch.equal(packed["padding_mask"], packed["segment_ids"] < 0)
    pairs = RewardPairs.__new__(RewardPairs)
    pairs.pad_id, pairs.pad_to, pairs.pad_multiple, pairs.pack_to = 0, None, 4, None
    rows = pairs.collate([{"chosen": seqs[0], "rejected": seqs[1], "margin": 0.0}])
    assert rows["padding_mask"].tolist() == [[False] * 5 + [True] * 3,
                                             [False] * 3 + [True] * 5]
    sft = SftDataset(None, [], 8, 0, packed=False, pad_to_seq_length=False, fingerprint="")
    items = [{"tokens": s[:-1], "labels": s[1:], "loss_mask": np.ones(len(s) - 1),
              "position_ids": np.arange(len(s) - 1)} for s in seqs[:2]]
    assert sft.collate(items)["padding_mask"].tolist() == [[False] * 4,
                                                           [False] * 2 + [True] * 2]
    from unittest import mock

    with mock.patch("megatron.core.parallel_state.get_context_parallel_world_size",
                    return_value=2), \
            mock.patch("megatron.core.parallel_state.get_context_parallel_rank",
                       return_value=1):
        split = on_this_cp_rank(padded, 2)
    # chunks 1 and 2 of 4 (megatron's split for rank 1 of 2): positions 2-5 of each row
    assert torch.equal(split["padding_mask"], padded["padding_mask"][:, 2:6])


@pytest.mark.benchmark
@pytest.mark.parametrize("mtp", [[], ["--mtp_num_layers", "1"]], ids=["", "mtp"])
@pytest.mark.parametrize("layout, compared", [
    (["--context_parallel_size", "2"], ("loss", "load_balancing_loss", "grad_norm")),
    # sft at TP=2 with sequence parallelism is 6e-5 off one rank's gradient norm at step 1
    # with or without the padding mask: not a routing matter, so not compared here
    (["--tensor_model_parallel_size", "2", "--sequence_parallel"],
     ("loss", "load_balancing_loss"))], ids=["cp2", "tp2_sp"])
def test_padded_sft_on_two_ranks_routes_as_one_rank(tmp_path, layout, compared, mtp):
    """sft rows padded to the longest of their micro-batch, at CP=2 further to a multiple of
    2 x CP positions (TP=2 with sequence parallelism: of TP), and each rank holding a
    different share of the padding: with the padding left out of routing, two ranks give one
    rank's LM loss, load-balancing loss and (CP) gradient norms (the z-loss's gradient with
    them), with the expert-bias update on, which moves the routing from step 2 by the
    counts. The logged z-loss is not compared: there it averages the ranks' means over their
    real tokens, which differ in number (docs/models.md). With an MoE MTP layer (its mask
    rolled over the CP ranks, or split over the TP ranks) its loss is compared too."""
    from run_helpers import one_turn_conversations, run_sft, train_records

    data = one_turn_conversations(tmp_path / "train.jsonl", WORDS)
    flags = [*MOE, "--moe_ffn_hidden_size", "32", "--moe_router_bias_update_rate", "0.05",
             "--moe_aux_loss_coeff", "0.1", "--moe_z_loss_coeff", "0.01", "--dataset", data,
             "--template", "plain", "--seq_length", "64", "--train_iters", "3", "--no_save",
             "--global_batch_size", "4", "--hidden_dropout", "0", "--attention_dropout", "0",
             *mtp]
    compared = compared + (("mtp_loss",) if mtp else ())
    run_sft(tmp_path / "one", *flags)
    run_sft(tmp_path / "two", *flags, *layout, nproc=2)
    ref, got = train_records(tmp_path / "one"), train_records(tmp_path / "two")
    assert [r["iteration"] for r in got] == [1, 2, 3]
    for r, g in zip(ref, got):
        for key in compared:
            assert abs(g[key] - r[key]) <= 1e-5, (g["iteration"], key, g[key], r[key])


@pytest.mark.benchmark
def test_padded_sft_with_an_mtp_layer_on_a_later_stage_routes_as_one_rank(tmp_path):
    """PP=2 x TP=2 with sequence parallelism: the MTP stage gets the padding mask already
    split over its TP ranks (training/moe_padding.py) and gathers it back to roll it for
    its MTP layer; from a one-rank checkpoint its LM, MTP and load-balancing losses are the
    one-rank run's (without the MTP layer's mask the load-balancing loss is 1.5e-3 off).
    The gradient norm is not compared (TP=2 with sequence parallelism, above)."""
    from run_helpers import one_turn_conversations, run_sft, train_records

    data = one_turn_conversations(tmp_path / "train.jsonl", WORDS)
    flags = [*MOE, "--moe_ffn_hidden_size", "32", "--moe_router_bias_update_rate", "0.05",
             "--moe_aux_loss_coeff", "0.1", "--moe_z_loss_coeff", "0.01", "--dataset", data,
             "--template", "plain", "--seq_length", "64", "--train_iters", "3",
             "--global_batch_size", "4", "--hidden_dropout", "0", "--attention_dropout", "0",
             "--num_layers", "4", "--mtp_num_layers", "1"]
    run_sft(tmp_path / "one", *flags, "--save_steps", "1")
    run_sft(tmp_path / "four", *flags, "--pipeline_model_parallel_size", "2",
            "--tensor_model_parallel_size", "2", "--sequence_parallel", "--no_save",
            "--resume", tmp_path / "one" / "checkpoint" / "iter_0000001", nproc=4,
            timeout=600)
    ref, got = train_records(tmp_path / "one")[1:], train_records(tmp_path / "four")
    assert [r["iteration"] for r in got] == [2, 3]
    for r, g in zip(ref, got):
        for key in ("loss", "mtp_loss", "load_balancing_loss"):
            assert abs(g[key] - r[key]) <= 1e-5, (g["iteration"], key, g[key], r[key])
