"""LoRA on mixture-of-experts models: every routed expert and the shared expert get their
own adapters (all-linear means them too), the log counts them, the merged export and the
peft adapter equal the LoRA model, and what peft cannot load is refused by name."""

import json

import pytest
import torch

from swift_mcore.arguments import RunArguments
from swift_mcore.errors import ArgumentError
from swift_mcore.run_config import resolve

SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
             seq_length=32, vocab_size=256, attention_backend="sdpa")
MOE = dict(num_experts=4, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=48,
           moe_layer_freq="[0,1]")


def lora_model(**flags):
    from swift_mcore.models import lora
    from swift_mcore.models.gpt import build_model
    from swift_mcore.runtime import seed

    config = resolve(RunArguments.from_flags(**SHAPE, **MOE, tuner_type="lora",
                                                  lora_rank=4, lora_dropout=0.0, **flags),
                     world_size=1).complete(256, None)
    seed.set_seed(1)
    model = build_model(config)[0]
    lora.apply(config, [model])
    return config, model


def test_all_linear_adapts_every_expert_and_the_count_is_the_truth(gloo_group):
    from swift_mcore.models import lora

    _, model = lora_model()
    adapted = {n.rsplit(".lora_", 1)[0] for n, p in model.named_parameters()
               if p.requires_grad}
    experts = {f"decoder.layers.1.mlp.experts.local_experts.{e}.{fc}"
               for e in range(4) for fc in ("linear_fc1", "linear_fc2")}
    shared = {f"decoder.layers.1.mlp.shared_experts.{fc}" for fc in ("linear_fc1", "linear_fc2")}
    dense = {f"decoder.layers.{i}.self_attention.{m}" for i in (0, 1)
             for m in ("linear_qkv", "linear_proj")} | {"decoder.layers.0.mlp.linear_fc1",
                                                        "decoder.layers.0.mlp.linear_fc2"}
    assert adapted == experts | shared | dense  # not the router
    # r * (in + out) per adapted layer, from the shapes: qkv 64->128, proj 64->64,
    # dense fc1 64->2*ffn (ffn 192 by default), fc2 192->64, expert fc1 64->64, fc2 32->64, shared 64->96, 48->64
    r = 4
    expected = (2 * r * (64 + 128) + 2 * r * (64 + 64) + r * (64 + 2 * 192) + r * (192 + 64)
                + 4 * (r * (64 + 64) + r * (32 + 64)) + r * (64 + 96) + r * (48 + 64))
    trainable, _ = lora.parameter_counts([model])
    assert trainable == expected


def test_naming_only_the_expert_linears_trains_them(gloo_group):
    _, model = lora_model(target_regex=r".*local_experts\.\d+\.linear_fc2")
    adapted = {n.rsplit(".lora_", 1)[0] for n, p in model.named_parameters()
               if p.requires_grad}
    assert adapted == {f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc2"
                       for e in range(4)}


LORA = ["--tuner_type", "lora", "--lora_rank", "4", "--lora_alpha", "16", "--lora_dropout",
        "0", "--attention_backend", "sdpa"]


def hf_adapter_size(hf, r: int) -> int:
    """r * (in + out) of every linear megatron adapts, from the HF model's own weights:
    q/k/v fused, each expert's gate/up fused (transformers 5 stacks the experts)."""
    total = 0
    for layer in hf.model.layers:
        attn = layer.self_attn
        qkv_out = sum(getattr(attn, p).weight.shape[0] for p in ("q_proj", "k_proj", "v_proj"))
        total += r * (attn.q_proj.weight.shape[1] + qkv_out) + r * sum(attn.o_proj.weight.shape)
        experts = layer.mlp.experts
        for e in range(experts.gate_up_proj.shape[0]):
            total += r * sum(experts.gate_up_proj[e].shape) + r * sum(experts.down_proj[e].shape)
    return total


@pytest.mark.slow
@pytest.mark.parametrize("family, expert", [
    ("qwen3_moe", "mlp.experts.3.up_proj"),
    ("mixtral", "block_sparse_moe.experts.3.w3"),  # transformers 4's names, on disk
])
def test_expert_adapters_train_merge_and_export_to_peft(tmp_path, train_here, family, expert):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import hf_helpers as H
    from test_hf_training import run_flags
    from test_moe_families import convert, make_moe

    from swift_mcore.loaded_model import forward_logits, load_model

    source = tmp_path / "hf"
    hf = make_moe(source, family)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(100)))
    out = tmp_path / "run"
    stdout = train_here(out, "--model", source, "--dataset", data, "--train_iters", "3",
                        "--save_steps", "3", "--lr", "1e-2", *LORA, command="pt",
                        base=run_flags()).stdout
    line = next(l for l in stdout.splitlines() if l.startswith("--tuner_type lora:"))
    assert line.startswith(f"--tuner_type lora: {hf_adapter_size(hf, 4):,} of ")

    checkpoint = out / "checkpoint" / "iter_0000003"
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    convert(checkpoint, merged, "to_hf", merge_lora=True)
    convert(checkpoint, adapter, "to_peft")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["lora_dropout"] == 0.0
    assert f"base_model.model.model.layers.1.{expert}.lora_B.weight" in \
        H.safetensors_state(str(adapter))

    tokens = H.tokens(vocab=300, length=32)
    quiet = lambda line: None  # noqa: E731
    ours = forward_logits(load_model(str(checkpoint), log=quiet).model, tokens)[..., :320]
    merged_logits = H.hf_logits(str(merged), tokens)
    base_logits = H.hf_logits(str(source), tokens)
    base = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32,
                                                attn_implementation="eager")
    peft_model = PeftModel.from_pretrained(base, str(adapter)).eval()
    with torch.no_grad():
        peft_logits = peft_model(tokens).logits
    # megatron's MoE layer against transformers' sums in another order (test_moe_training's
    # bound)
    assert (merged_logits - ours).abs().max() < 1e-4
    assert (merged_logits - base_logits).abs().max() > 1e-2  # the adapters trained
    # peft's model of the exported adapter, unmerged (x W + (x A) B, in its own order) and
    # merged by peft: the function of our merged export.
    assert (peft_logits - merged_logits).abs().max() < 1e-4
    peft_merged = peft_model.merge_and_unload()
    with torch.no_grad():
        assert (peft_merged(tokens).logits - merged_logits).abs().max() < 1e-5
    theirs = peft_merged.state_dict()
    mine = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).state_dict()
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
                 "model.layers.0.self_attn.k_proj.weight"):
        assert torch.allclose(mine[name], theirs[name], rtol=0, atol=1e-6), name


@pytest.mark.parametrize("flags, message", [
    # a dense layer's (and the shared expert's) gate/up/down: peft maps those names onto
    # the experts' stacked parameters
    ({}, "--to_peft: model.layers.0.mlp.down_proj has an adapter, and peft maps every "
         "module of that name onto the MoE experts' stacked parameters"),
    (dict(target_regex=r".*local_experts\.[01]\.linear_fc2"),
     "--to_peft: decoder.layers.1 has linear_fc2 adapters on experts [0, 1] of 4; peft "
     "loads expert adapters onto transformers 5's stacked expert parameters, all of a "
     "layer's experts or none (export --to_hf --merge_lora instead)"),
])
def test_what_peft_cannot_load_is_refused_by_name(gloo_group, flags, message):
    from swift_mcore.models import lora
    from swift_mcore.models.convert import Layout

    config, model = lora_model(**flags)
    layout = Layout.from_model_args(config.model, config.padded_vocab_size)
    with pytest.raises(ArgumentError) as err:
        lora.peft_adapter(model, config.tuner, layout, None)
    assert message in str(err.value)


def test_grouped_experts_with_adapters_are_refused():
    from swift_mcore.models import lora

    # resolve's part for LoRA (on the CPU resolve refuses --moe_grouped_gemm before it)
    args = RunArguments.from_flags(**SHAPE, **MOE, moe_grouped_gemm=True,
                                        tuner_type="lora")
    with pytest.raises(ArgumentError, match="--tuner_type lora with --moe_grouped_gemm: the "
                                            "grouped experts' linears have no LoRA layer"):
        lora.check(args, "local")


@pytest.mark.slow
def test_ep2_trains_the_expert_adapters_as_one_rank_does(tmp_path, train_here):
    """EP=2: each rank holds, reduces and checkpoints its experts' adapters; the losses, the
    logged count and the merged export are the one-rank run's."""
    import hf_helpers as H
    from run_helpers import losses
    from test_hf_training import continue_pretraining, run_flags
    from test_moe_families import convert, make_moe

    source = tmp_path / "hf"
    hf = make_moe(source, "qwen3_moe")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(100)))
    flags = ["--train_iters", "3", "--save_steps", "3", "--lr", "1e-2", *LORA]
    one = train_here(tmp_path / "ep1", "--model", source, "--dataset", data, *flags,
                     command="pt", base=run_flags()).stdout
    two = continue_pretraining(source, data, tmp_path / "ep2", *flags,
                               "--expert_model_parallel_size", "2", nproc=2)
    count = f"--tuner_type lora: {hf_adapter_size(hf, 4):,} of "
    assert count in one and count in two
    ref, got = losses(tmp_path / "ep1"), losses(tmp_path / "ep2")
    assert sorted(got) == [1, 2, 3]
    assert max(abs(got[i] - ref[i]) for i in ref) < 1e-5
    merged = {}
    for run in ("ep1", "ep2"):
        convert(tmp_path / run / "checkpoint" / "iter_0000003", tmp_path / f"{run}_merged",
                "to_hf", merge_lora=True)
        merged[run] = H.safetensors_state(str(tmp_path / f"{run}_merged"))
    base = H.safetensors_state(str(source))
    name = "model.layers.1.mlp.experts.3.down_proj.weight"  # an expert of EP rank 1
    assert not torch.equal(merged["ep2"][name], base[name])
    for key, value in merged["ep1"].items():
        assert torch.allclose(merged["ep2"][key], value, rtol=0, atol=1e-5), key


def test_a_lora_checkpoint_without_the_expert_bias_still_loads(tmp_path, train_here,
                                                               monkeypatch):
    """LoRA checkpoints keep the routers' expert bias (test_mtp_hf's resume test); one
    written before they did (its adapters alone) still loads, with the base model's bias."""
    from run_helpers import TINY
    from swift_mcore.loaded_model import load_model
    from swift_mcore.models import lora

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b): return a + b  # {i}"})
                            + "\n" for i in range(16)))
    trainable = lambda chunk: {n for n, p in chunk.named_parameters()  # noqa: E731
                               if p.requires_grad}
    monkeypatch.setattr(lora, "_kept", trainable)  # what a LoRA checkpoint held before
    train_here(tmp_path / "run", "--dataset", data, "--train_iters", "1", "--save_steps", "1",
               "--num_experts", "4", "--moe_ffn_hidden_size", "32",
               "--moe_router_score_function", "sigmoid", "--moe_router_enable_expert_bias",
               "--moe_router_bias_update_rate", "0.05", *LORA, command="pt", base=TINY)
    monkeypatch.undo()
    model = load_model(str(tmp_path / "run" / "checkpoint"), log=lambda line: None).model
    assert torch.equal(model.decoder.layers[1].mlp.router.expert_bias, torch.zeros(4))


def test_to_peft_refuses_a_bias_moved_before_a_resume_at_rate_0(tmp_path, train_here):
    """An expert bias moved in training and then resumed with --moe_router_bias_update_rate 0
    (which the checkpoint's flags then say) is still not the base model's: --to_peft compares
    the bias itself with the base's and refuses by name, instead of writing an adapter that
    drops the trained routing; a run at rate 0 throughout still exports."""
    from hf_helpers import convert
    from run_helpers import TINY

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b): return a + b  # {i}"})
                            + "\n" for i in range(16)))
    flags = ["--dataset", data, "--lr_decay_iters", "4", "--num_experts", "4",
             "--moe_ffn_hidden_size", "32", "--moe_router_score_function", "sigmoid",
             "--moe_router_enable_expert_bias", *LORA, "--target_modules", "linear_qkv"]
    moved, still = tmp_path / "moved", tmp_path / "still"
    train_here(moved, *flags, "--train_iters", "1", "--save_steps", "1",
               "--moe_router_bias_update_rate", "0.05", command="pt", base=TINY)
    train_here(still, *flags, "--train_iters", "2", "--save_steps", "2",
               "--moe_router_bias_update_rate", "0", "--resume",
               moved / "checkpoint" / "iter_0000001", command="pt", base=TINY)
    with pytest.raises(ArgumentError, match=r"^--to_peft: --model .*iter_0000002 holds "
                                            r"routers' expert bias .*moved from the base"):
        convert(still / "checkpoint" / "iter_0000002", tmp_path / "peft", "to_peft")
    assert not (tmp_path / "peft" / "adapter_config.json").exists()

    plain = tmp_path / "plain"
    train_here(plain, *flags, "--train_iters", "1", "--save_steps", "1",
               "--moe_router_bias_update_rate", "0", command="pt", base=TINY)
    assert convert(plain / "checkpoint" / "iter_0000001", tmp_path / "ok", "to_peft")["tensors"]
