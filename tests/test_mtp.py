"""Multi-token prediction (--mtp_num_layers, megatron's MTP block): a run trains it, logs its
loss beside the LM loss (per layer too), and its loss reaches the gradients by
--mtp_loss_scaling_factor; what it does not run with yet is refused in one line."""

import json

import pytest

from in_process import train_in_process
from run_helpers import train_records
from swift_mcore.errors import ArgumentError


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtp") / "data.jsonl"
    path.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(200)))
    return path


def test_mtp_loss_is_logged_apart_and_trains_the_model(tmp_path, gloo_group, data):
    runs = {}
    for factor in ("0.5", "0"):
        out = tmp_path / factor
        stdout = train_in_process(out, "--dataset", data, "--train_iters", "3", "--no_save",
                                  "--mtp_num_layers", "2", "--mtp_loss_scaling_factor", factor,
                                  command="pt").stdout
        assert "| mtp_loss " in stdout
        runs[factor] = train_records(out)
    weighted, unweighted = runs["0.5"], runs["0"]
    for record in weighted:
        assert record["mtp_loss"] == pytest.approx(
            (record["mtp_1_loss"] + record["mtp_2_loss"]) / 2, abs=1e-6)
        assert 5 < record["mtp_2_loss"] < 10  # a cross entropy over 4096 tokens, near ln 4096
    # the same first step: the MTP loss weighs nothing in the forward pass ...
    assert weighted[0]["loss"] == unweighted[0]["loss"]
    assert weighted[0]["mtp_loss"] == unweighted[0]["mtp_loss"]
    # ... and in the gradients only with a weight: the LM losses then part
    assert weighted[2]["loss"] != unweighted[2]["loss"]
    # trained with weight 0 the MTP layers stay where they started; with a weight they learn
    assert weighted[2]["mtp_loss"] < unweighted[2]["mtp_loss"]


@pytest.mark.parametrize("flags, message", [
    (dict(mtp_loss_scaling_factor=0.3),
     r"^--mtp_loss_scaling_factor weighs the multi-token prediction loss: it needs "
     r"--mtp_num_layers N > 0$"),
    (dict(mtp_num_layers=1, recompute_granularity="full", recompute_method="uniform",
          recompute_num_layers=2),
     r"^--mtp_num_layers 1 with --recompute_method uniform needs --recompute_num_layers 1"),
    (dict(mtp_num_layers=-1), r"^--mtp_num_layers"),
])
def test_what_mtp_does_not_run_with_is_refused(flags, message):
    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve

    world_size = flags.pop("world_size", 1)
    with pytest.raises(ArgumentError, match=message):
        resolve(RunArguments.from_flags(**{"num_layers": 2, "global_batch_size": 8, **flags}),
                world_size=world_size)


def test_mtp_with_the_interleaved_pipeline_is_accepted():
    """megatron builds the MTP block (and its embedding copy) on the last rank's last virtual
    chunk (get_mtp_num_layers_to_build asks is_pipeline_last_stage with the chunk's vp_stage)
    and reduces that copy's gradient with the first stage's (finalize_model_grads takes
    model[-1] there); test_interleaved_pipeline_gives_the_one_rank_losses runs it."""
    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve

    config = resolve(RunArguments.from_flags(
        num_layers=4, global_batch_size=8, mtp_num_layers=1, pipeline_model_parallel_size=2,
        num_layers_per_virtual_pipeline_stage=1), world_size=2)
    assert config.model.mtp_num_layers == 1


@pytest.mark.benchmark  # outside the suite's time budget: run with -m benchmark
def test_interleaved_pipeline_gives_the_one_rank_losses_resumes_and_reshards(tmp_path, data):
    """PP=2 x 2 virtual stages with one MTP layer (on rank 1's second chunk, beside a copy of
    the embedding): from a one-rank checkpoint (resharded into the four chunks) its LM and
    MTP losses and gradient norms are the one-rank run's, its own checkpoint resumes bit for
    bit, and continues at PP=1 with the same losses."""
    from run_helpers import run_pt

    shape = ["--dataset", data, "--num_layers", "4", "--train_iters", "4",
             "--mtp_num_layers", "1", "--hidden_dropout", "0", "--attention_dropout", "0"]
    vpp = ["--pipeline_model_parallel_size", "2", "--num_virtual_stages_per_pipeline_rank",
           "2"]
    keys = ("loss", "mtp_loss", "grad_norm")

    def records(out):
        return {r["iteration"]: r for r in train_records(out)}

    def close(got, ref):
        for it, record in got.items():
            for key in keys:
                assert abs(record[key] - ref[it][key]) <= 1e-5, (it, key, record, ref[it])

    run_pt(tmp_path / "one", *shape, "--save_steps", "1")
    run_pt(tmp_path / "vpp", *shape, *vpp, "--save_steps", "2", "--resume",
           tmp_path / "one" / "checkpoint" / "iter_0000001", nproc=2, timeout=600)
    ref, got = records(tmp_path / "one"), records(tmp_path / "vpp")
    assert sorted(got) == [2, 3, 4]
    close(got, ref)
    saved = tmp_path / "vpp" / "checkpoint" / "iter_0000002"
    run_pt(tmp_path / "again", *shape, *vpp, "--no_save", "--resume", saved, nproc=2,
           timeout=600)
    again = records(tmp_path / "again")
    assert sorted(again) == [3, 4]
    for it, record in again.items():
        assert all(record[key] == got[it][key] for key in keys), (record, got[it])
    run_pt(tmp_path / "pp1", *shape, "--no_save", "--resume", saved)
    flat = records(tmp_path / "pp1")
    assert sorted(flat) == [3, 4]
    close(flat, got)


def test_mtp_with_rlhf_or_packed_mrope_rows_is_refused(tmp_path):
    from swift_mcore.arguments import RlhfArguments, SftArguments, parse_args
    from swift_mcore.run_config import resolve

    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    packed = parse_args(["--dataset", str(data), "--packing", "true", "--mtp_num_layers",
                         "1"], cls=SftArguments)
    packed.check_mtp()  # text rows: the shift stays inside each conversation
    packed.model.position_embedding_type = "mrope"  # a vision-language model's positions
    with pytest.raises(ArgumentError, match=r"^--mtp_num_layers 1 with --packing and "
                                            r"multimodal positions \(mrope\): not supported"):
        packed.check_mtp()
    with pytest.raises(ArgumentError, match=r"^--mtp_num_layers 2 with rlhf: the preference"):
        resolve(parse_args(["--dataset", str(data), "--mtp_num_layers", "2"],
                           cls=RlhfArguments), world_size=1)


def test_router_losses_average_over_the_moe_mtp_layers_too(gloo_group):
    """An MoE model's MTP layer is an MoE layer (like the decoder's last); its router tracks
    its losses after the decoder's, and the logged average counts it."""
    import torch
    from megatron.core.transformer.moe import moe_utils

    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve
    from swift_mcore.training import moe_metrics

    config = resolve(RunArguments.from_flags(
        num_layers=2, micro_batch_size=1, global_batch_size=4, num_experts=4,
        moe_aux_loss_coeff=0.01, moe_layer_freq="[0,1]", mtp_num_layers=1), world_size=1)
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    tracker.clear()
    # the decoder's MoE layer (layer 2) and the MTP layer's router (layer 3 of 2 + 1)
    moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(3.0), 2, 3)
    moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(5.0), 3, 3)
    # two MoE layers, 4 micro-batches
    assert moe_metrics.collect(config) == {"load_balancing_loss": pytest.approx(8.0 / 2 / 4)}
    tracker.clear()


@pytest.mark.benchmark  # outside the suite's time budget: run with -m benchmark
def test_dp2_gives_the_dp1_losses(tmp_path, data):
    """Two data-parallel ranks (megatron's MTP tracker averaged over them with gloo) log
    the one-rank LM and MTP losses."""
    from run_helpers import run_pt

    runs = {}
    for nproc in (1, 2):
        run_pt(tmp_path / f"dp{nproc}", "--dataset", data, "--train_iters", "3", "--no_save",
               "--mtp_num_layers", "2", nproc=nproc)
        runs[nproc] = train_records(tmp_path / f"dp{nproc}")
    for a, b in zip(runs[1], runs[2]):
        for key in ("loss", "mtp_loss", "mtp_1_loss", "mtp_2_loss"):
            assert abs(a[key] - b[key]) < 1e-5, (key, a, b)


def test_a_checkpoint_with_mtp_layers_resumes_or_loads_only_with_them(tmp_path, gloo_group,
                                                                      data):
    """The MTP layers are part of the model's shape: resuming (or --load --finetune) a
    checkpoint that has them without --mtp_num_layers would drop them; refused by name."""
    from swift_mcore.errors import CheckpointError

    out = tmp_path / "run"
    train_in_process(out, "--dataset", data, "--train_iters", "1", "--save_steps", "1",
                     "--mtp_num_layers", "1", command="pt")
    for flags in (["--resume", out / "checkpoint"],
                  ["--load", out / "checkpoint", "--finetune"]):
        with pytest.raises((ArgumentError, CheckpointError),
                           match=r"--mtp_num_layers: checkpoint 1, now unset"):
            train_in_process(tmp_path / "again", "--dataset", data, "--train_iters", "1",
                             "--no_save", *flags, command="pt")


@pytest.mark.benchmark  # outside the suite's time budget: run with -m benchmark
def test_cp2_gives_the_one_rank_losses_and_gradients(tmp_path, data):
    """Context parallelism: megatron rolls each MTP layer's inputs, labels and loss mask
    across the CP ranks' sequence chunks (roll_tensor, over gloo here); the LM and MTP
    losses (each layer's) and the gradient norms are the one-rank run's."""
    from run_helpers import run_pt

    flags = ["--dataset", data, "--train_iters", "3", "--no_save", "--mtp_num_layers", "2",
             "--hidden_dropout", "0", "--attention_dropout", "0"]
    runs = {}
    for cp in (1, 2):
        run_pt(tmp_path / f"cp{cp}", *flags, "--context_parallel_size", str(cp), nproc=cp)
        runs[cp] = train_records(tmp_path / f"cp{cp}")
    assert [r["iteration"] for r in runs[2]] == [1, 2, 3]
    for a, b in zip(runs[1], runs[2]):
        for key in ("loss", "mtp_loss", "mtp_1_loss", "mtp_2_loss", "grad_norm"):
            assert abs(a[key] - b[key]) < 1e-5, (key, a, b)


def test_lora_targets_of_the_mtp_layers():
    """all-linear adapts each MTP layer's transformer layer as the decoder's, not its
    eh_proj, which --target_modules names; a model without MTP layers has no eh_proj."""
    from swift_mcore.arguments import RunArguments
    from swift_mcore.models import lora

    def targets(**flags):
        args = RunArguments.from_flags(num_layers=2, tuner_type="lora", **flags)
        return lora.select_targets(args.tuner, args.model)

    mtp = [n for n in targets(mtp_num_layers=1) if n.startswith("mtp.")]
    assert mtp == [f"mtp.layers.0.transformer_layer.{m}" for m in (
        "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
        "mlp.linear_fc2")]
    assert targets(mtp_num_layers=2, target_modules=["eh_proj"]) == [
        "mtp.layers.0.eh_proj", "mtp.layers.1.eh_proj"]
    assert targets(mtp_num_layers=1, target_regex=r"mtp\..*(eh_proj|linear_proj)") == [
        "mtp.layers.0.eh_proj", "mtp.layers.0.transformer_layer.self_attention.linear_proj"]
    with pytest.raises(ArgumentError, match=r"^--target_modules: this model has no eh_proj "
                                            r"layer; its linear layers are linear_qkv, "):
        targets(target_modules=["eh_proj"])


def test_a_packed_row_gives_each_conversation_s_own_mtp_loss(gloo_group):
    """Packed rows behind the block-causal mask: the MTP layer's shifted inputs, labels and
    loss mask stay inside each conversation, so the MTP loss summed over a packed row's
    targets is the sum of its conversations' own, each alone in a row."""
    import torch
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from swift_mcore.arguments import RunArguments
    from swift_mcore.data.packing import block_causal_mask
    from swift_mcore.models.gpt import build_model
    from swift_mcore.run_config import resolve
    from swift_mcore.runtime import seed

    config = resolve(RunArguments.from_flags(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        seq_length=32, vocab_size=256, mtp_num_layers=2, hidden_dropout=0.0,
        attention_dropout=0.0, global_batch_size=8), world_size=1).complete(256, None)
    seed.set_seed(1)
    model = build_model(config)[0].train()
    generator = torch.Generator().manual_seed(0)
    conversations = [torch.randint(1, 256, (n + 1,), generator=generator) for n in (9, 13)]

    def mtp_sums(rows, masks=None):
        """(sum over each layer's counted targets) of one batch of rows."""
        tokens = torch.stack([r["tokens"] for r in rows])
        mask = torch.stack([r["loss_mask"] for r in rows])
        MTPLossLoggingHelper.tracker.clear()
        with torch.no_grad():
            model(input_ids=tokens, position_ids=torch.stack([r["position_ids"] for r in rows]),
                  attention_mask=masks, labels=torch.stack([r["labels"] for r in rows]),
                  loss_mask=mask)
        means = MTPLossLoggingHelper.tracker["values"].clone()
        MTPLossLoggingHelper.tracker.clear()
        # each depth k counts the targets whose position is k + 1 inside its conversation
        counts = [sum(max(0, int(r["lengths"][i]) - k - 1) for r in rows
                      for i in range(len(r["lengths"]))) for k in range(2)]
        return [float(m) * c for m, c in zip(means, counts)]

    def row(ids):
        n = len(ids) - 1
        return {"tokens": ids[:-1], "labels": ids[1:], "loss_mask": torch.ones(n),
                "position_ids": torch.arange(n), "lengths": [n]}

    alone = [mtp_sums([row(ids)]) for ids in conversations]
    pad = 3
    packed = {"tokens": torch.cat([c[:-1] for c in conversations] + [torch.zeros(pad).long()]),
              "labels": torch.cat([c[1:] for c in conversations] + [torch.zeros(pad).long()]),
              "loss_mask": torch.cat([torch.ones(9), torch.ones(13), torch.zeros(pad)]),
              "position_ids": torch.cat([torch.arange(9), torch.arange(13),
                                         torch.zeros(pad).long()]),
              "lengths": [9, 13]}
    segments = torch.cat([torch.zeros(9), torch.ones(13), torch.full((pad,), -1)]).long()
    together = mtp_sums([packed], block_causal_mask(segments[None]))
    for k in range(2):
        assert together[k] == pytest.approx(alone[0][k] + alone[1][k], rel=1e-5), k


@pytest.mark.benchmark  # outside the suite's time budget: run with -m benchmark
def test_packed_sft_at_cp2_gives_the_one_rank_losses(tmp_path):
    """sft --packing with an MTP layer, at CP=2 (the shift kept inside each conversation
    and rolled over the ranks' chunks) against one rank: LM and MTP losses and gradient
    norms within 1e-5."""
    from run_helpers import run_sft, short_conversations

    data = short_conversations(tmp_path / "train.jsonl",
                               "alpha beta gamma delta river stone cloud paper".split())
    flags = ["--dataset", data, "--template", "plain", "--seq_length", "64", "--packing",
             "--train_iters", "2", "--no_save", "--global_batch_size", "4",
             "--mtp_num_layers", "1", "--hidden_dropout", "0", "--attention_dropout", "0"]
    run_sft(tmp_path / "one", *flags)
    run_sft(tmp_path / "cp2", *flags, "--context_parallel_size", "2", nproc=2)
    ref, got = train_records(tmp_path / "one"), train_records(tmp_path / "cp2")
    assert [r["iteration"] for r in got] == [1, 2]
    for a, b in zip(ref, got):
        for key in ("loss", "mtp_loss", "grad_norm"):
            assert abs(a[key] - b[key]) < 1e-5, (key, a, b)
