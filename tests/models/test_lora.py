"""LoRA (--tuner_type lora): bad flags, logits at initialization, what trains, TP/PP and
resume against one rank, adapters-only checkpoints tied to their base, and both exports
(merged Hugging Face weights, a peft adapter) against peft's own arithmetic."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import hf_helpers as H
from run_helpers import ROOT, child_env, losses
from test_hf_training import continue_pretraining, run_flags

from swift_mcore.arguments import RunArguments
from swift_mcore.errors import ArgumentError
from swift_mcore.run_config import resolve

LORA = ["--tuner_type", "lora", "--lora_rank", "4", "--lora_alpha", "16", "--lora_dropout",
        "0", "--attention_backend", "sdpa"]
SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
             seq_length=32, vocab_size=256, attention_backend="sdpa")


@pytest.mark.parametrize("flags, message", [
    (dict(tuner_type="lora", lora_rank=0), "--lora_rank must be a positive integer"),
    (dict(tuner_type="lora", target_modules="q_proj,o_proj"),
     "megatron fuses k_proj, q_proj, v_proj into one layer (linear_qkv); give all of them"),
    (dict(tuner_type="lora", target_modules="attn"), "--target_modules: unknown module 'attn'"),
    (dict(tuner_type="lora", target_regex=r".*\.layers\.7\..*"),
     "--target_regex '.*\\\\.layers\\\\.7\\\\..*' matches no linear layer"),
    (dict(tuner_type="lora", target_regex="(("), "is not a valid regular expression"),
    (dict(lora_rank=4), "--lora_rank configures LoRA adapters: add --tuner_type lora"),
    (dict(tuner_type="lora", modules_to_save="norm"), "--modules_to_save 'norm'"),
    # the output layer of a tied model is the embedding: nothing of its own to save
    (dict(tuner_type="lora", modules_to_save="lm_head",
          untie_embeddings_and_output_weights=False),
     "--modules_to_save lm_head: this model ties its output layer to the word embeddings"),
    # 2 layers x r*(192 + 128 + 448 + 256) against 2 x (8192 + 4096 + 24576 + 12288)
    (dict(tuner_type="lora", lora_rank=44),
     "--lora_rank 44: the adapters would hold 90,112 parameters, 92% of the 98,304 of the 8 "
     "layers they adapt (--lora_max_fraction 0.5); that is no longer a low-rank adapter: "
     "lower --lora_rank, train with --tuner_type full, or raise --lora_max_fraction"),
    (dict(tuner_type="lora", lora_rank=25, target_modules="linear_qkv"), "--lora_rank 25: "),
])
def test_bad_lora_flags_are_refused_naming_the_flag(flags, message):
    with pytest.raises(ArgumentError) as err:
        resolve(RunArguments.from_flags(**SHAPE, **flags), world_size=1)
    assert message in str(err.value)


def test_sequence_parallel_takes_lora_without_dropout_on_cpu():
    sp = dict(SHAPE, tuner_type="lora", tensor_model_parallel_size=2, sequence_parallel=True)
    with pytest.raises(ArgumentError) as err:  # --lora_dropout's default, 0.05
        resolve(RunArguments.from_flags(**sp), world_size=2, cuda=False)
    assert str(err.value).startswith("--lora_dropout 0.05 with --sequence_parallel on CPU: ")
    assert "set --lora_dropout 0 or drop --sequence_parallel" in str(err.value)
    resolve(RunArguments.from_flags(**sp, lora_dropout=0.0), world_size=2, cuda=False)


def test_lora_rank_bounds_and_its_override():
    resolve(RunArguments.from_flags(**SHAPE, tuner_type="lora", lora_rank=24),
            world_size=1)  # exactly half of the adapted layers' parameters: accepted
    resolve(RunArguments.from_flags(**SHAPE, tuner_type="lora", lora_rank=44,
                                         lora_max_fraction=1.0), world_size=1)


def test_the_cli_refuses_a_huge_rank_before_any_work(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "pt", *run_flags(),
                           "--num_layers", "2", "--hidden_size", "64", "--num_attention_heads",
                           "4", "--num_query_groups", "2", "--tuner_type", "lora",
                           "--lora_rank", "44", "--output_dir", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env=child_env())
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "--lora_rank 44: the adapters would hold 90,112 parameters, 92% of the 98,304 of the "
        "8 layers they adapt (--lora_max_fraction 0.5); that is no longer a low-rank adapter: "
        "lower --lora_rank, train with --tuner_type full, or raise --lora_max_fraction")
    assert not out.exists()


def test_merge_lora_needs_to_hf():
    from swift_mcore.arguments.export import ExportArguments

    with pytest.raises(ArgumentError, match="--merge_lora writes merged Hugging Face "
                                            "weights: it goes with --to_hf"):
        ExportArguments(model=str(ROOT), output_dir="/tmp/x", to_peft=True,
                        merge_lora=True).validate()


def test_adapters_start_as_the_base_model_and_merge_as_peft_does(gloo_group):
    from swift_mcore.loaded_model import forward_logits
    from swift_mcore.models import lora
    from swift_mcore.models.lora_layer import LoraParallelLinear
    from swift_mcore.models.gpt import build_model
    from swift_mcore.runtime import seed

    config = resolve(RunArguments.from_flags(**SHAPE, tuner_type="lora", lora_rank=4,
                                                  lora_dropout=0.0,
                                                  target_regex=r".*(linear_qkv|linear_fc2)"),
                     world_size=1).complete(256, None)
    seed.set_seed(1)
    model = build_model(config)[0]
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    base = forward_logits(model, tokens)
    lora.apply(config, [model])
    assert torch.equal(forward_logits(model, tokens), base)  # B = 0: exactly the base
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"decoder.layers.{i}.{m}.lora_{f}.default.weight" for i in (0, 1)
                         for m in ("self_attention.linear_qkv", "mlp.linear_fc2")
                         for f in "AB"}
    layer = model.decoder.layers[0].self_attention.linear_qkv
    weight = layer.base_layer.weight.detach().clone()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraParallelLinear):
                module.lora_B["default"].weight.normal_(0, 0.05)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected = weight + (b @ a) * (32 / 4)  # alpha/r
    unmerged = forward_logits(model, tokens)
    assert (unmerged - base).abs().max() > 1e-3
    lora.merge_and_unload(model)
    assert not any(isinstance(m, LoraParallelLinear) for m in model.modules())
    assert torch.equal(model.decoder.layers[0].self_attention.linear_qkv.weight, expected)
    assert torch.allclose(forward_logits(model, tokens), unmerged, atol=1e-5)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA run on a tiny Llama folder, 4 iterations at TP=1 (checkpoints at 2 and 4)."""
    root = tmp_path_factory.mktemp("lora")
    H.make_family(str(root / "hf"), "llama", initializer_range=0.05)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(200)))
    stdout = continue_pretraining(root / "hf", data, root / "tp1", *LORA, "--save_steps", "2")
    return root, data, stdout


@pytest.mark.slow
def test_only_the_adapters_train_and_the_log_says_how_many(trained):
    root, _, stdout = trained
    # 2 layers x (qkv 4x64+128x4, proj 4x64+64x4, fc1 4x64+192x4, fc2 4x96+64x4)
    line = next(l for l in stdout.splitlines() if l.startswith("--tuner_type lora:"))
    assert line.startswith("--tuner_type lora: 5,888 of 108,608 parameters train (5.42%)")
    run = json.loads((root / "tp1/checkpoint/iter_0000004/run.json").read_text())
    assert run["base_model"].startswith("sha256:")
    curve = losses(root / "tp1")
    assert curve[4] < curve[1]


def resume_copy(root, name, *flags, nproc=1, source="tp1", at=2):
    """Run ``source`` resumed from its iteration-``at`` checkpoint in a copy of its folder
    (the later checkpoints and the losses left out)."""
    run = root / name
    shutil.copytree(root / source, run)
    for later in range(at + 1, 5):
        shutil.rmtree(run / "checkpoint" / f"iter_{later:07d}", ignore_errors=True)
    (run / "metrics.jsonl").unlink()
    continue_pretraining(root / "hf", trained_data(root), run, *LORA, "--resume",
                         str(run / "checkpoint" / f"iter_{at:07d}"), *flags, nproc=nproc)
    return losses(run)


def trained_data(root):
    return root / "data.jsonl"


# TP=2 with whole layers recomputed in the backward pass: the same function, resumable.
TP2 = ("--tensor_model_parallel_size", "2", "--recompute_granularity", "full")
PP2 = ("--pipeline_model_parallel_size", "2")


@pytest.mark.slow
def test_tp2_and_pp2_give_the_one_rank_losses_and_resume_is_exact(trained):
    root, data, _ = trained
    reference = losses(root / "tp1")
    # One rank, resumed at iteration 2: bit-exact.
    assert resume_copy(root, "resumed") == {3: reference[3], 4: reference[4]}
    # PP=2 straight through (saving at 2 and 4): the one-rank losses; resumed at iteration 2
    # from its own checkpoint: its own losses bit for bit.
    continue_pretraining(root / "hf", data, root / "pp2", *LORA, *PP2, "--save_steps", "2",
                         nproc=2)
    pp2 = losses(root / "pp2")
    assert sorted(pp2) == [1, 2, 3, 4]
    assert max(abs(pp2[i] - reference[i]) for i in reference) < 1e-5
    assert resume_copy(root, "pp2_resumed", *PP2, nproc=2, source="pp2") == \
        {3: pp2[3], 4: pp2[4]}
    # Resumed at TP=2 with full recompute from the one-rank checkpoint (the adapters and
    # their Adam state resharded): the one-rank losses. Full recompute changes nothing: the
    # adapters inside the recomputed layers train (they would not if the frozen embedding's
    # output were left without requires_grad, and loss 4 would differ).
    tp2 = resume_copy(root, "tp2_from_tp1", *TP2, "--save_steps", "1", nproc=2)
    assert sorted(tp2) == [3, 4]
    assert max(abs(tp2[i] - reference[i]) for i in tp2) < 1e-5
    # ... and that TP=2 run resumed from its own iteration-3 checkpoint: bit-exact at TP=2.
    assert resume_copy(root, "tp2_resumed", *TP2, nproc=2, source="tp2_from_tp1", at=3) == \
        {4: tp2[4]}


SP = ("--tensor_model_parallel_size", "2", "--sequence_parallel")


@pytest.mark.benchmark
def test_sequence_parallel_gives_the_one_rank_run_and_its_merged_export(trained, gloo_group,
                                                                        tmp_path):
    from run_helpers import train_records

    from swift_mcore.arguments.export import ExportArguments
    from swift_mcore.export import run

    root, data, _ = trained
    continue_pretraining(root / "hf", data, root / "sp", *LORA, *SP, "--save_steps", "2",
                         nproc=2)
    # Each rank holds a slice of the sequence: the replicated factors' gradients are parts,
    # summed over the TP ranks (without that the grad norm is 1.448 for 1.606 at step 1).
    one = {r["iteration"]: r for r in train_records(root / "tp1")}
    sp = {r["iteration"]: r for r in train_records(root / "sp")}
    assert sorted(sp) == sorted(one) == [1, 2, 3, 4]
    for key in ("loss", "grad_norm"):
        assert max(abs(sp[i][key] - one[i][key]) for i in one) < 1e-5, key
    assert resume_copy(root, "sp_resumed", *SP, nproc=2, source="sp") == \
        {3: sp[3]["loss"], 4: sp[4]["loss"]}
    quiet = lambda line: None  # noqa: E731
    tokens = H.tokens(vocab=300, length=32)
    logits = {}
    for name in ("tp1", "sp"):
        out = tmp_path / name
        run(ExportArguments(model=str(root / name / "checkpoint" / "iter_0000004"),
                            output_dir=str(out), to_hf=True, merge_lora=True).validate(),
            log=quiet)
        logits[name] = H.hf_logits(str(out), tokens)
    assert (logits["sp"] - logits["tp1"]).abs().max() < 1e-5
    assert (logits["sp"] - H.hf_logits(str(root / "hf"), tokens)).abs().max() > 1e-2


@pytest.mark.slow
def test_resume_on_other_base_weights_is_refused_naming_the_field(trained):
    root, data, _ = trained
    other = root / "other_hf"
    shutil.copytree(root / "hf", other)
    H.make_family(str(other), "llama", seed=1, initializer_range=0.05)  # same shapes
    run = root / "other_run"
    shutil.copytree(root / "tp1", run)
    cmd = [sys.executable, "-m", "swift_mcore", "pt", *run_flags(), "--model", str(other),
           "--dataset", str(data), "--train_iters", "6", "--output_dir", str(run), *LORA,
           "--resume", "auto"]
    before = sorted(os.listdir(run / "checkpoint"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env=child_env())
    assert proc.returncode != 0
    assert "base_model (the frozen base weights): checkpoint sha256:" in proc.stderr
    assert f"(--model {other})" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(os.listdir(run / "checkpoint")) == before


@pytest.mark.slow
def test_merged_and_peft_exports_equal_the_lora_model(trained, gloo_group, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from swift_mcore.arguments.export import ExportArguments
    from swift_mcore.export import run
    from swift_mcore.loaded_model import forward_logits, load_model

    root = trained[0]
    checkpoint = root / "tp1" / "checkpoint" / "iter_0000004"
    quiet = lambda line: None  # noqa: E731
    with pytest.raises(ArgumentError, match="is a LoRA checkpoint .* add --merge_lora"):
        run(ExportArguments(model=str(checkpoint), output_dir=str(tmp_path / "plain"),
                            to_hf=True).validate(), log=quiet)
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    run(ExportArguments(model=str(checkpoint), output_dir=str(merged), to_hf=True,
                        merge_lora=True).validate(), log=quiet)
    run(ExportArguments(model=str(checkpoint), output_dir=str(adapter),
                        to_peft=True).validate(), log=quiet)
    assert sorted(os.listdir(adapter)) == ["adapter_config.json", "adapter_model.safetensors"]

    tokens = H.tokens(vocab=300, length=32)
    ours = forward_logits(load_model(str(checkpoint), log=quiet).model, tokens)[..., :320]
    merged_logits = H.hf_logits(str(merged), tokens)
    base_logits = H.hf_logits(str(root / "hf"), tokens)
    base = AutoModelForCausalLM.from_pretrained(str(root / "hf"), dtype=torch.float32,
                                                attn_implementation="eager")
    peft_model = PeftModel.from_pretrained(base, str(adapter)).eval()
    with torch.no_grad():
        peft_logits = peft_model(tokens).logits
    assert (merged_logits - ours).abs().max() < 1e-5
    assert (peft_logits - merged_logits).abs().max() < 1e-5
    assert (merged_logits - base_logits).abs().max() > 1e-2  # the merge is not a no-op
    # The merged weights are peft's merge_and_unload of the exported adapter, exactly.
    theirs = peft_model.merge_and_unload().state_dict()
    for name, value in H.safetensors_state(str(merged)).items():
        assert torch.equal(value, theirs[name]), name


@pytest.mark.slow
def test_a_lora_checkpoint_is_a_small_fraction_of_a_full_one(tmp_path, train_here):
    sizes = {}
    for kind, extra in (("full", []), ("lora", ["--tuner_type", "lora", "--lora_rank", "2"])):
        train_here(tmp_path / kind, "--hidden_size", "256", "--train_iters", "1", *extra,
                   command="pt")
        folder = tmp_path / kind / "checkpoint" / "iter_0000001"
        sizes[kind] = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert sizes["full"] > 20 * sizes["lora"], sizes


@pytest.mark.slow
def test_sft_with_packing_at_dp2_and_recompute_gives_the_one_rank_losses(tmp_path,
                                                                         train_here):
    from run_helpers import run_sft

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"add {i} and {i + 1}" + " please" * (i % 5)},
        {"role": "assistant", "content": f"{2 * i + 1}"}]}) + "\n" for i in range(40)))
    common = ["--dataset", data, "--template", "plain", "--seq_length", "64", "--packing",
              "--train_iters", "2", "--no_save", *LORA]
    one = train_here(tmp_path / "dp1", *common)
    run_sft(tmp_path / "dp2", *common, "--recompute_granularity", "selective", nproc=2)
    assert "--tuner_type lora:" in one.stdout
    reference, dp2 = losses(tmp_path / "dp1"), losses(tmp_path / "dp2")
    assert sorted(reference) == sorted(dp2) == [1, 2]
    assert max(abs(dp2[i] - reference[i]) for i in reference) < 1e-5
