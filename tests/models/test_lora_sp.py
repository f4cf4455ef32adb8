"""LoRA under --sequence_parallel at TP=2: the adapters of a column- and a row-parallel
linear, fed a slice of the sequence, give the whole computation's output and gradients
once megatron has summed the marked gradients over the TP ranks; as decoder linears and as
a routed expert's (tokens gathered by the dispatcher)."""

import json

import pytest

import lora_sp_helpers as S


@pytest.mark.slow
def test_adapters_on_a_sequence_slice_give_the_whole_computation(tmp_path):
    from two_ranks import run_two_ranks

    for rank, result in enumerate(run_two_ranks(S.__file__, tmp_path, 240)):
        assert sorted(result) == ["decoder", "expert"]
        for case, differences in result.items():
            worst = max(differences, key=differences.get)
            assert differences[worst] < 1e-5, (rank, case, differences)


def sp_runs(tmp_path, train_here, source, layouts, *flags):
    """A LoRA pt run of ``source`` on one rank and in each of ``layouts`` (name -> (ranks,
    parallel flags)): {name: {iteration: record}}."""
    from run_helpers import train_records
    from test_hf_training import continue_pretraining, run_flags
    from test_lora_moe import LORA

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(100)))
    common = ("--train_iters", "3", "--save_steps", "3", *LORA, *flags)
    train_here(tmp_path / "one", "--model", source, "--dataset", data, *common, command="pt",
               base=run_flags())
    for name, (nproc, parallel) in layouts.items():
        continue_pretraining(source, data, tmp_path / name, *common, *parallel, nproc=nproc)
    return {name: {r["iteration"]: r for r in train_records(tmp_path / name)}
            for name in ("one", *layouts)}


SP = ("--tensor_model_parallel_size", "2", "--sequence_parallel")


@pytest.mark.benchmark
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_moe_families_with_expert_adapters_at_tp2_give_the_one_rank_run(tmp_path, train_here,
                                                                          family):
    """Adapters on attention (MLA's projections for DeepSeek-V3), the shared expert and
    every routed expert: TP=2 with sequence parallelism (the experts split over the TP
    ranks, or whole on each with --expert_tensor_parallel_size 1, which gpt-oss's biased
    experts need) and TP=2 x EP=2 on 4 ranks give the one-rank losses and gradient norms
    within 1e-5; the TP=2 checkpoint's merged export gives the one-rank export's logits
    within 1e-4."""
    import hf_helpers as H
    from test_deepseek_v3 import make_deepseek
    from test_gpt_oss import make_gpt_oss
    from test_moe_families import make_moe

    source = tmp_path / "hf"
    make = {"deepseek_v3": make_deepseek, "gpt_oss": make_gpt_oss}
    make[family](source) if family in make else make_moe(source, family)
    whole = (*SP, "--expert_tensor_parallel_size", "1")
    layouts = {"sp": (2, whole if family == "gpt_oss" else SP)}
    if family != "gpt_oss":
        layouts["sp_ep2"] = (4, (*SP, "--expert_model_parallel_size", "2"))
    if family == "qwen3_moe":
        layouts["sp_etp1"] = (2, whole)
    runs = sp_runs(tmp_path, train_here, source, layouts, "--lr", "1e-2", "--min_lr", "1e-2")
    one = runs.pop("one")
    assert sorted(one) == [1, 2, 3] and one[3]["loss"] < one[1]["loss"]
    for name, run in runs.items():
        assert sorted(run) == [1, 2, 3], name
        for key in ("loss", "grad_norm"):
            assert max(abs(run[i][key] - one[i][key]) for i in one) < 1e-5, (name, key)
    tokens = H.tokens(vocab=300, length=32)
    logits = {}
    for name in ("one", "sp"):
        H.convert(tmp_path / name / "checkpoint" / "iter_0000003", tmp_path / f"{name}-merged",
                  "to_hf", merge_lora=True)
        logits[name] = H.hf_logits(str(tmp_path / f"{name}-merged"), tokens)
    # after 3 Adam steps at lr 1e-2 the two runs' rounding differences in near-zero
    # gradient entries move single weights by up to lr-size steps: 4.4e-5 here (logits ~4)
    assert (logits["sp"] - logits["one"]).abs().max() < 1e-4
    assert (logits["one"] - H.hf_logits(str(source), tokens)).abs().max() > 1e-2


@pytest.mark.benchmark
def test_delta_net_adapters_at_tp2_give_the_one_rank_run(tmp_path, train_here):
    """Qwen3-Next (gated delta nets, gated attention, MoE): adapters on the delta nets'
    in_proj/out_proj too. Its gradient norms are ~25 and their float rounding grows fast
    (at lr 1e-2 full-parameter training at TP=2 leaves one rank's norm by 1% at step 3,
    LoRA by 0.6%; at lr 1e-3 LoRA by a relative 7.5e-6): compared relative to the norm, at
    lr 1e-3."""
    from test_qwen3_next import make_next

    make_next(tmp_path / "hf")
    runs = sp_runs(tmp_path, train_here, tmp_path / "hf", {"sp": (2, SP)}, "--lr", "1e-3",
                   "--min_lr", "1e-3")
    one, sp = runs["one"], runs["sp"]
    assert sorted(sp) == sorted(one) == [1, 2, 3] and one[3]["loss"] < one[1]["loss"]
    assert max(abs(sp[i]["loss"] - one[i]["loss"]) for i in one) < 1e-5
    assert max(abs(sp[i]["grad_norm"] / one[i]["grad_norm"] - 1) for i in one) < 2e-5


@pytest.mark.benchmark
def test_tower_and_language_model_adapters_at_tp2_give_the_one_rank_run(tmp_path,
                                                                        train_here):
    """Qwen3-VL sft with images, adapters on the vision tower (--freeze_vit false, whole on
    each TP rank) and on the language model's layers: TP=2 with sequence parallelism gives
    the one-rank losses and gradient norms."""
    from run_helpers import train_records
    from test_hf_training import run_flags
    from test_qwen3_vl import (image_dataset, make_qwen3_vl, sft_two_ranks,
                               write_processor_files)
    from test_lora_moe import LORA

    folder = tmp_path / "hf"
    make_qwen3_vl(folder)
    write_processor_files(folder)
    flags = ["--model", folder, "--dataset", image_dataset(tmp_path, rows=8), "--seq_length",
             "64", "--lr", "5e-2", "--min_lr", "5e-2", "--train_iters", "3", "--template",
             "tokenizer", *LORA, "--freeze_vit", "false", "--no_save"]
    train_here(tmp_path / "one", *flags, base=run_flags())
    sft_two_ranks(tmp_path / "sp", *flags, *SP)
    one, sp = ({r["iteration"]: r for r in train_records(tmp_path / name)}
               for name in ("one", "sp"))
    assert sorted(sp) == sorted(one) == [1, 2, 3] and one[3]["loss"] < one[1]["loss"]
    for key in ("loss", "grad_norm"):
        assert max(abs(sp[i][key] - one[i][key]) for i in one) < 1e-5, (key, one, sp)
