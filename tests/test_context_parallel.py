"""--context_parallel_size: each sequence split over the CP ranks as megatron balances it (2 x CP
chunks), the CPU port's attention over the group, the loss reduced over it. A CP=2 run gives
the one-rank run's losses and gradient norms (pt, and sft with packed rows); it resumes
exactly at CP=2 and continues at CP=1; bad layouts are refused before any work."""

import copy
import json

import pytest
import torch

from fake_group import GroupRank
from run_helpers import losses, run_pt, run_sft, short_conversations, train_records
from swift_mcore.arguments import RunArguments, SftArguments
from swift_mcore.errors import ArgumentError
from swift_mcore.run_config import resolve
from swift_mcore.runtime.cpu.all_gather_attention import chunk_order, local_positions


# ---- the split: megatron's own, and the attention's view of it -----------------------------
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_the_attention_knows_where_megatron_put_each_rank_s_tokens(cp, monkeypatch):
    """megatron's get_batch_on_this_cp_rank gives rank r the positions local_positions says,
    and the rank-ordered all-gather of every rank's piece, reordered by chunk_order, is the
    sequence again."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    seq = 8 * cp
    pieces = []
    for rank in range(cp):
        monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp)
        monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda r=rank: r)
        got = get_batch_on_this_cp_rank({"tokens": torch.arange(seq)[None, :]})["tokens"][0]
        assert torch.equal(got, local_positions(cp, rank, seq // cp))
        pieces.append(got)
    gathered = torch.cat(pieces).view(2 * cp, -1)
    assert torch.equal(gathered.index_select(0, chunk_order(cp)).reshape(-1),
                       torch.arange(seq))


def test_the_trainer_splits_each_sequence_field_and_keeps_the_token_count(monkeypatch):
    from megatron.core import parallel_state

    from swift_mcore.training.trainer import on_this_cp_rank

    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda: 1)
    seq = torch.arange(8)[None, :]
    mask = torch.zeros(1, 1, 8, 8, dtype=torch.bool)
    batch = {"tokens": seq, "labels": seq + 1, "loss_mask": torch.ones(1, 8),
             "position_ids": seq, "attention_mask": mask, "sample_ids": torch.tensor([5])}
    out = on_this_cp_rank(batch, 2)
    assert out["tokens"].tolist() == [[2, 3, 4, 5]] and out["labels"].tolist() == [[3, 4, 5, 6]]
    assert out["attention_mask"].shape == (1, 1, 4, 8)  # query rows cut, every key kept
    assert out["sample_ids"].tolist() == [5] and float(out["num_tokens"]) * 2 == 8


def test_kto_s_kl_rows_and_orpo_s_row_mask_are_cut_like_the_rows(monkeypatch):
    """rlhf rows beside the model's inputs: KTO's KL rows (kl_*) and ORPO's mask over every
    position (sequence_mask) are this rank's chunks too, the KL rows' mask by its query
    rows (a field megatron's split would cut on the wrong axis by its name)."""
    from megatron.core import parallel_state

    from swift_mcore.training.trainer import on_this_cp_rank

    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda: 1)
    seq = torch.arange(8)[None, :]
    batch = {"tokens": seq, "kl_tokens": seq + 10, "kl_loss_mask": seq.float(),
             "kl_position_ids": seq, "kl_attention_mask": torch.zeros(1, 1, 8, 8),
             "sequence_mask": seq.float() + 0.5}
    out = on_this_cp_rank(batch, 2)
    assert out["kl_tokens"].tolist() == [[12, 13, 14, 15]]
    assert out["kl_loss_mask"].tolist() == [[2.0, 3.0, 4.0, 5.0]]
    assert out["kl_position_ids"].tolist() == [[2, 3, 4, 5]]
    assert out["kl_attention_mask"].shape == (1, 1, 4, 8)
    assert out["sequence_mask"].tolist() == [[2.5, 3.5, 4.5, 5.5]]


def test_gemma3_s_local_rope_table_is_this_rank_s_chunks(gloo_group, monkeypatch):
    """Gemma 3's window layers swap in their own RoPE table: under CP=2 it is the whole
    sequence's local table cut to this rank's chunks, as GPTModel's global one (whose
    length, two chunks, is all the layer sees)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.attention import SelfAttention

    from swift_mcore.models.gemma3_layers import Gemma3SelfAttention

    seq, seen = 16, {}
    monkeypatch.setattr(SelfAttention, "forward",
                        lambda self, hidden, mask, *a, **kw: seen.update(kw))
    full_table = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, rotary_base=10,
                                 use_cpu_initialization=True, cp_group=GroupRank(0)).get_emb(seq)
    for rank in range(2):
        layer = Gemma3SelfAttention.__new__(Gemma3SelfAttention)
        torch.nn.Module.__init__(layer)
        layer.local_rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0,
                                           rotary_base=10, use_cpu_initialization=True,
                                           cp_group=GroupRank(rank))
        global_table = torch.zeros(seq // 2, 1, 1, 8)  # this rank's two chunks
        layer.forward(None, None, rotary_pos_emb=global_table)
        where = local_positions(2, rank, seq // 2)
        assert torch.equal(seen["rotary_pos_emb"], full_table[where])


# ---- the attention: in blocks of keys, against SDPA's dense mask and megatron's own path ----
def within_1e6(got, ref):
    """float32's rounding apart: within 1e-6 of the largest value (at least 1)."""
    assert (got - ref).abs().max() <= 1e-6 * max(1.0, float(ref.abs().max()))


def dense_sdpa(q, k, v, keep, scale):
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=keep, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


@pytest.mark.parametrize("case", ["causal", "window", "packed", "none"])
def test_blocked_attention_equals_sdpa_with_the_dense_mask(case, monkeypatch):
    """Outputs and gradients of the key-block attention equal SDPA's over the dense mask of
    the same positions (CP=2 rank 1's queries over a 40-token sequence, blocks of 8 keys, 4
    heads over 2 key/value groups)."""
    from swift_mcore.runtime.cpu import blocked_attention as blocked

    monkeypatch.setattr(blocked, "KEY_BLOCK", 8)
    torch.manual_seed(0)
    seq, b = 40, 2
    q_pos = local_positions(2, 1, seq // 2)
    k_pos = torch.arange(seq)
    hidden, window, causal = None, None, case != "none"
    keep = torch.ones(len(q_pos), seq, dtype=torch.bool)
    if case in ("causal", "window"):
        keep = k_pos[None] <= q_pos[:, None]
    if case == "window":
        window = (5, 0)
        keep = keep & (k_pos[None] >= q_pos[:, None] - 5)
    if case == "packed":  # rows of 13, 17 and 10 tokens in row 0; 25 and 15 in row 1
        doc = torch.tensor([[0] * 13 + [1] * 17 + [2] * 10, [0] * 25 + [1] * 15])
        whole = (doc[:, :, None] == doc[:, None, :]) & (k_pos[None, None] <= k_pos[:, None])
        keep = whole[:, None, q_pos]  # [b, 1, sq, seq]
        hidden = ~keep
    q = torch.randn(b, 4, len(q_pos), 16, requires_grad=True)
    k, v = (torch.randn(b, 2, seq, 16, requires_grad=True) for _ in range(2))
    weight = torch.randn(b, 4, len(q_pos), 16)
    got = blocked.blocked_attention(q, k, v, blocked.Visibility(q_pos, causal, window, hidden),
                                    0.3)
    grads = torch.autograd.grad((got * weight).sum(), (q, k, v))
    ref = dense_sdpa(q, k, v, keep, 0.3)
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    within_1e6(got, ref)
    for one, other in zip(grads, ref_grads):
        within_1e6(one, other)


def test_blocked_attention_s_dropout_is_the_same_in_both_passes(monkeypatch):
    """With dropout, the backward pass redraws the forward pass's masks: the gradients are
    those of the output actually computed (checked against finite differences of a
    fixed-seed forward)."""
    from swift_mcore.runtime.cpu import blocked_attention as blocked

    monkeypatch.setattr(blocked, "KEY_BLOCK", 4)
    torch.manual_seed(1)
    q = torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 1, 12, 4, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    seen = blocked.Visibility(torch.arange(6, 12), True, None, None)

    def run(*inputs, p=0.3):
        return blocked._BlockedAttention.apply(inputs[0].view(1, 1, 2, 6, 4),
                                               inputs[1][:, :, None], inputs[2][:, :, None],
                                               seen, 0.5, p, 1234)

    assert not torch.allclose(run(q, k, v), run(q, k, v, p=0.0))  # dropout acts
    assert torch.autograd.gradcheck(run, (q, k, v))


@pytest.mark.parametrize("case", ["causal", "window", "packed"])
def test_cp_attention_equals_megatron_s_own_attention(case, gloo_group, monkeypatch):
    """Two simulated CP ranks' GatheredKVAttention, their outputs put back in sequence order,
    give megatron's DotProductAttention over the whole sequence, and the same gradients of
    the whole sequence's queries, keys and values."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from swift_mcore.models.gpt import transformer_config
    from swift_mcore.runtime.cpu import blocked_attention as blocked
    from swift_mcore.runtime.cpu.all_gather_attention import GatheredKVAttention
    from swift_mcore.runtime.seed import set_seed

    set_seed(2, cuda=False)  # megatron's attention forks the tracker even without dropout
    monkeypatch.setattr(blocked, "KEY_BLOCK", 8)
    extra = dict(window_size=6) if case == "window" else {}
    config = resolve(RunArguments.from_flags(**SMALL, context_parallel_size=2,
                                             num_query_groups=2, attention_dropout=0.0,
                                             **extra), world_size=2, cuda=False)
    tconfig = transformer_config(config)
    cp_attention = GatheredKVAttention(tconfig, 1, AttnMaskType.causal, "self").eval()
    single = copy.copy(tconfig)
    single.context_parallel_size = 1
    mask_type = AttnMaskType.arbitrary if case == "packed" else AttnMaskType.causal
    megatron_s = DotProductAttention(single, 1, mask_type, "self").eval()
    if case == "window":
        assert cp_attention.window is not None

    torch.manual_seed(2)
    seq, b = SMALL["seq_length"], 2
    q = torch.randn(seq, b, 4, 16, requires_grad=True)
    k, v = (torch.randn(seq, b, 2, 16, requires_grad=True) for _ in range(2))
    weight = torch.randn(seq, b, 64)
    mask = None
    if case == "packed":
        doc = torch.tensor([[0] * 11 + [1] * 21, [0] * 7 + [1] * 9 + [2] * 16])
        pos = torch.arange(seq)
        mask = ~((doc[:, :, None] == doc[:, None, :]) & (pos[None, None] <= pos[:, None]))
        mask = mask[:, None]  # hides, [b, 1, seq, seq]
    ref = megatron_s(q, k, v, mask)
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))

    where = [local_positions(2, rank, seq // 2) for rank in range(2)]
    pieces = {}

    monkeypatch.setattr(tensor_parallel, "gather_from_sequence_parallel_region",
                        lambda local, **_: torch.cat(pieces[id(local)]))
    out = torch.zeros(seq, b, 64)
    for rank in range(2):
        monkeypatch.setattr(parallel_state, "get_context_parallel_group",
                            lambda r=rank: GroupRank(r))
        local = [t.index_select(0, where[rank]) for t in (q, k, v)]
        for whole, piece in zip((k, v), local[1:]):
            pieces[id(piece)] = [piece if r == rank else whole.index_select(0, where[r])
                                 for r in range(2)]
        local_mask = None if mask is None else mask[:, :, where[rank]]
        out = out.index_put((where[rank],), cp_attention(*local, local_mask))
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    within_1e6(out, ref)
    for one, other in zip(grads, ref_grads):
        within_1e6(one, other)


# ---- refused before any work ---------------------------------------------------------------
SMALL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
             micro_batch_size=1, global_batch_size=4)


@pytest.mark.parametrize("flags,world,cuda,message", [
    (dict(context_parallel_size=2, seq_length=30), 2, False,
     r"--seq_length \(30\) must be a multiple of 2 x --context_parallel_size \(4\)"),
    (dict(context_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True,
          seq_length=36), 4, False, r"x --tensor_model_parallel_size \(--sequence_parallel\)"),
    (dict(context_parallel_size=2), 3, False, r"x --context_parallel_size \(2\)"),
    (dict(context_parallel_size=0), 1, False, "--context_parallel_size"),
    (dict(context_parallel_size=2, cp_comm_type="p2p"), 2, False,
     "--cp_comm_type p2p is Transformer Engine's"),
    (dict(cp_comm_type="a2a"), 1, False, "--cp_comm_type needs --context_parallel_size > 1"),
    (dict(context_parallel_size=2, attention_backend="local"), 2, False,
     "needs --attention_backend sdpa or auto"),
    (dict(context_parallel_size=2), 2, True, "needs Transformer Engine's attention"),
])
def test_bad_layouts_are_refused_in_one_line(flags, world, cuda, message):
    with pytest.raises(ArgumentError, match=message) as err:
        resolve(RunArguments.from_flags(**{**SMALL, **flags}), world_size=world, cuda=cuda,
                transformer_engine=False)
    assert "\n" not in str(err.value)


def test_packed_rows_with_te_are_refused_on_gpu(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "a"},
                                             {"role": "assistant", "content": "b"}]}) + "\n")
    args = SftArguments.from_flags(**SMALL, dataset=[str(data)], packing=True,
                                   context_parallel_size=2)
    with pytest.raises(ArgumentError, match="--packing with --context_parallel_size 2 on GPU"):
        resolve(args, world_size=2, cuda=True, transformer_engine=True)


def test_moe_takes_cp_with_the_router_losses_weighed_as_on_one_rank():
    """megatron-core 0.16.1 weighs a rank's router losses by the tokens it routes, 1/(TP x
    CP) of the sequence: the coefficients it gets are the flags' times TP x CP."""
    from swift_mcore.models.gpt import transformer_config

    flags = dict(**SMALL, num_experts=4, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.01,
                 moe_z_loss_coeff=0.001)
    config = resolve(RunArguments.from_flags(**flags, context_parallel_size=2), world_size=2,
                     cuda=False)
    got = transformer_config(config)
    assert (got.moe_aux_loss_coeff, got.moe_z_loss_coeff) == (0.02, 0.002)


def test_the_layout_counts_cp_apart_from_dp():
    config = resolve(RunArguments.from_flags(**SMALL, context_parallel_size=2), world_size=4,
                     cuda=False)
    assert (config.world.context_parallel, config.world.data_parallel) == (2, 2)
    assert config.world.num_microbatches == 2


# ---- the memory estimate (models/footprint.py) ---------------------------------------------
def test_the_estimate_counts_what_the_cp_attention_keeps(gloo_group, monkeypatch):
    """The bytes the CPU context-parallel attention keeps for the backward pass (measured on
    rank 0 of a simulated CP=2 group: the gathered keys and values, no mask) are
    what the memory estimate adds for one layer."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.enums import AttnMaskType

    from swift_mcore.models import footprint
    from swift_mcore.models.gpt import transformer_config
    from swift_mcore.runtime.cpu.all_gather_attention import GatheredKVAttention

    config = resolve(RunArguments.from_flags(**SMALL, context_parallel_size=2,
                                             num_query_groups=2), world_size=2, cuda=False)
    attention = GatheredKVAttention(transformer_config(config), 1, AttnMaskType.causal,
                                    "self")

    # rank 0 of two; the other rank's half of the sequence is this one's again
    monkeypatch.setattr(parallel_state, "get_context_parallel_group", lambda: GroupRank(0))
    monkeypatch.setattr(tensor_parallel, "gather_from_sequence_parallel_region",
                        lambda local, **_: torch.cat([local, local.detach() + 1]))
    seq, local = SMALL["seq_length"], SMALL["seq_length"] // 2
    query = torch.randn(local, 1, 4, 16, requires_grad=True)
    key, value = (torch.randn(local, 1, 2, 16, requires_grad=True)
                  for _ in range(2))
    saved = {}

    def keep(tensor):
        if seq in tensor.shape:  # over the whole sequence: what CP adds (not q, out, lse)
            saved[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        attention(query, key, value, None)
    measured = sum(saved.values())
    assert measured == footprint.gathered_kv_bytes(config, 1, 4) > 0  # fp32
    # every layer's stays for the backward pass; recomputed, one layer's at a time
    assert footprint.gathered_kv_bytes(config, 2, 4) == 2 * measured
    for recompute in ("full", "selective"):
        again = resolve(RunArguments.from_flags(**SMALL, context_parallel_size=2,
                                                num_query_groups=2,
                                                recompute_granularity=recompute),
                        world_size=2, cuda=False)
        assert footprint.gathered_kv_bytes(again, 2, 4) == measured, recompute


def test_cp_divides_the_activations_and_lets_a_refused_run_fit(monkeypatch):
    """Each CP rank holds 2 of the 2 x CP chunks of a sequence: a run refused at CP=1 for its
    activations fits at CP=2 (plus the gathered keys and values), within the same memory."""
    from swift_mcore.models import footprint

    long = {**SMALL, "seq_length": 1024, "vocab_size": 32000}

    def activations(cp, world):
        flags = RunArguments.from_flags(**long, context_parallel_size=cp)
        found = footprint.parts(resolve(flags, world_size=world, cuda=False), world, "fp32",
                                False)
        return {part.name: part.bytes for part in found}

    one, two = activations(1, 1), activations(2, 2)
    # layer inputs and logits, halved; keys and values of 2 layers, 4 heads x 16 channels
    # each (fp32), and no mask
    gathered = 2 * (2 * 1024 * 4 * 16 * 4)
    assert two["activations"] == one["activations"] // 2 + gathered
    room = (sum(one.values()) + sum(two.values())) // 2
    assert sum(two.values()) < room < sum(one.values())
    monkeypatch.setattr(footprint, "available", lambda cuda, ranks: (room, "a small machine"))
    with pytest.raises(ArgumentError, match="--vocab_size 32000 makes the model too large"):
        resolve(RunArguments.from_flags(**long), world_size=1, cuda=False)
    resolve(RunArguments.from_flags(**long, context_parallel_size=2), world_size=2,
            cuda=False)


# ---- CP=2 against one rank -----------------------------------------------------------------
def assert_close(got, ref, tol=1e-5):
    assert sorted(got) == sorted(ref)
    for it in ref:
        assert abs(got[it] - ref[it]) <= tol, (it, got[it], ref[it])


def val_losses(out):
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return {r["iteration"]: r["val_loss"] for r in records if r["split"] == "valid"}


def grad_norms(out):
    return {r["iteration"]: r["grad_norm"] for r in train_records(out)}


@pytest.fixture(scope="module")
def pt_runs(tmp_path_factory):
    """One rank and CP=2, 4 iterations each, saving at 2, with the distributed optimizer
    (at CP=2 it shards over the DP x CP ranks). Dropout off: the ranks draw their own
    masks, as on GPU."""
    base = tmp_path_factory.mktemp("cp")
    flags = ["--train_iters", "4", "--save_steps", "2", "--hidden_dropout", "0",
             "--attention_dropout", "0", "--use_distributed_optimizer", "--eval_steps", "4",
             "--eval_iters", "1"]
    run_pt(base / "one", *flags)
    proc = run_pt(base / "cp2", *flags, "--context_parallel_size", "2", nproc=2)
    return base, flags, proc.stdout


@pytest.mark.slow
def test_cp2_gives_the_one_rank_losses_and_gradients(pt_runs):
    base, _, stdout = pt_runs
    assert_close(losses(base / "cp2"), losses(base / "one"))
    assert_close(grad_norms(base / "cp2"), grad_norms(base / "one"))
    tokens = [r["tokens"] for r in train_records(base / "cp2")]
    assert tokens == [r["tokens"] for r in train_records(base / "one")] == [256.0] * 4
    assert "TP 1 x PP 1 x CP 2 x DP 1" in stdout
    assert_close(val_losses(base / "cp2"), val_losses(base / "one"))
    assert sorted(val_losses(base / "one")) == [4]


@pytest.mark.benchmark
def test_cp2_resumes_exactly_and_continues_at_cp1_and_the_reverse(pt_runs):
    base, flags, _ = pt_runs
    saved = base / "cp2" / "checkpoint" / "iter_0000002"
    run_pt(base / "again", *flags, "--context_parallel_size", "2", "--resume", saved,
           "--no_save", nproc=2)
    straight = losses(base / "cp2")
    assert losses(base / "again") == {it: straight[it] for it in (3, 4)}  # bit for bit
    run_pt(base / "to_cp1", *flags, "--resume", saved, "--no_save")
    assert_close(losses(base / "to_cp1"), {it: straight[it] for it in (3, 4)})
    one = losses(base / "one")
    run_pt(base / "to_cp2", *flags, "--context_parallel_size", "2", "--no_save", "--resume",
           base / "one" / "checkpoint" / "iter_0000002", nproc=2)
    assert_close(losses(base / "to_cp2"), {it: one[it] for it in (3, 4)})


WORDS = "alpha beta gamma delta river stone cloud paper orange silver seven north".split()


@pytest.mark.benchmark
def test_packed_sft_rows_with_cp2_give_the_one_rank_losses(tmp_path):
    """Packed rows keep their conversations apart under CP: the block-causal mask's query
    rows are cut like the tokens, and its key columns stay in sequence order."""
    data = short_conversations(tmp_path / "train.jsonl", WORDS)
    flags = ["--dataset", data, "--template", "plain", "--seq_length", "64", "--packing",
             "--train_iters", "2", "--no_save", "--global_batch_size", "4",
             "--hidden_dropout", "0", "--attention_dropout", "0"]
    run_sft(tmp_path / "one", *flags)
    run_sft(tmp_path / "cp2", *flags, "--context_parallel_size", "2", nproc=2)
    assert_close(losses(tmp_path / "cp2"), losses(tmp_path / "one"))
    assert_close(grad_norms(tmp_path / "cp2"), grad_norms(tmp_path / "one"))


@pytest.mark.benchmark
def test_moe_with_cp2_gives_the_one_rank_losses_router_losses_and_gradients(tmp_path):
    """A tiny MoE model (4 experts, top 2, strong router losses) at CP=2 against one rank:
    LM loss, load-balancing loss, z-loss and gradient norms within 1e-5 (without the
    router-loss scale the gradient norms are 2e-3 off at step 1)."""
    router = ["--num_experts", "4", "--moe_router_topk", "2", "--moe_ffn_hidden_size", "32",
              "--moe_aux_loss_coeff", "0.1", "--moe_z_loss_coeff", "0.01"]
    flags = [*router, "--train_iters", "3", "--no_save", "--hidden_dropout", "0",
             "--attention_dropout", "0"]
    run_pt(tmp_path / "one", *flags)
    run_pt(tmp_path / "cp2", *flags, "--context_parallel_size", "2", nproc=2)
    ref, got = train_records(tmp_path / "one"), train_records(tmp_path / "cp2")
    assert [r["iteration"] for r in got] == [1, 2, 3]
    for r, g in zip(ref, got):
        for key in ("loss", "load_balancing_loss", "z_loss", "grad_norm"):
            assert abs(g[key] - r[key]) <= 1e-5, (g["iteration"], key, g[key], r[key])


@pytest.mark.benchmark
def test_cp2_with_tp2_on_four_ranks_gives_the_one_rank_losses(tmp_path):
    """CP=2 x TP=2 with --sequence_parallel (4 ranks; left out of the suite for its time):
    the one-rank losses, and TP=2's gradient norms (TP=2 alone differs from one rank by
    about 2e-5 there, CP adds nothing to it)."""
    flags = ["--train_iters", "3", "--no_save", "--hidden_dropout", "0",
             "--attention_dropout", "0"]
    tp2 = ["--tensor_model_parallel_size", "2", "--sequence_parallel"]
    run_pt(tmp_path / "one", *flags)
    run_pt(tmp_path / "tp2", *flags, *tp2, nproc=2, timeout=600)
    run_pt(tmp_path / "cp2tp2", *flags, *tp2, "--context_parallel_size", "2", nproc=4,
           timeout=600)
    assert_close(losses(tmp_path / "cp2tp2"), losses(tmp_path / "one"))
    assert_close(grad_norms(tmp_path / "cp2tp2"), grad_norms(tmp_path / "tp2"), tol=1e-6)


@pytest.mark.benchmark
def test_cp2_with_pp2_on_four_ranks_gives_pp2_s_losses(tmp_path):
    """CP=2 x PP=2 (4 ranks; the p2p activations are a CP rank's part of the sequence)
    against PP=2 alone (whose stages draw their initial weights apart from one rank's)."""
    flags = ["--train_iters", "3", "--no_save", "--hidden_dropout", "0",
             "--attention_dropout", "0", "--pipeline_model_parallel_size", "2"]
    run_pt(tmp_path / "pp2", *flags, nproc=2, timeout=600)
    run_pt(tmp_path / "cp2pp2", *flags, "--context_parallel_size", "2", nproc=4, timeout=600)
    assert_close(losses(tmp_path / "cp2pp2"), losses(tmp_path / "pp2"))
    assert_close(grad_norms(tmp_path / "cp2pp2"), grad_norms(tmp_path / "pp2"))
