"""Qwen3.5 text models, dense and MoE: tiny random qwen3_5_text and qwen3_5_moe_text folders
(three gated delta-net layers with Qwen3.5's four input projections, one gated attention
layer) give transformers' logits; HF -> checkpoint -> HF is bit-identical; LoRA on the
delta nets exports as a peft adapter peft loads; a
vision-language folder whose files hold no language model is refused by name
(test_multimodal_text.py trains the language model of one that does)."""

import json

import pytest
import torch

import hf_helpers as H
from swift_mcore.errors import ArgumentError

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU delta rule")

HYBRID = dict(num_hidden_layers=4, head_dim=16,
              layer_types=["linear_attention"] * 3 + ["full_attention"],
              linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_num_key_heads=2, linear_num_value_heads=4,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                               "partial_rotary_factor": 0.5},
              initializer_range=0.1)  # as test_qwen3_next.py
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)


def make(path, model_type, **extra):
    model = H.make_model(str(path), model_type, **{**HYBRID, **extra})
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "dt_bias" in name or "A_log" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(str(path))
    return model


@pytest.mark.parametrize("model_type, family, extra", [
    ("qwen3_5_text", "qwen3_5", {}),
    ("qwen3_5_moe_text", "qwen3_5_moe", MOE),
])
def test_logits_match_and_round_trip_is_bit_identical(tmp_path, gloo_group, model_type, family,
                                                      extra):
    from swift_mcore.loaded_model import forward_logits, load_model

    folder = tmp_path / "hf"
    make(folder, model_type, **extra)
    loaded = load_model(str(folder), log=lambda line: None)
    m = loaded.config.model
    assert (m.model_type, m.linear_attention_freq, m.rotary_percent) == (
        family, "[1,1,1,0]", 0.5)
    # 64 tokens, as --test_convert_precision: with every layer MoE the float32 rounding of
    # transformers' and megatron's different GEMM shapes reaches ~1e-4 by 80 tokens here
    ids = H.tokens(length=64)
    ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    assert (ours - H.hf_logits(str(folder), ids)).abs().max() <= 1e-4
    config = H.check_round_trip(folder, tmp_path)
    assert config["model_type"] == model_type and config["layer_types"] == HYBRID["layer_types"]


def test_a_bfloat16_folder_keeps_its_float32_delta_net_tensors(tmp_path, gloo_group):
    """The Hub's Qwen3.5 files hold each delta net's A_log and norm in float32 beside
    bfloat16 weights: HF -> mcore -> HF gives every tensor back bit for bit, in its own dtype
    (they were rounded to bfloat16)."""
    from safetensors.torch import save_file

    source = tmp_path / "hf"
    make(source, "qwen3_5_text")
    state = {name: tensor if name.endswith(("A_log", "linear_attn.norm.weight"))
             else tensor.bfloat16() for name, tensor in H.safetensors_state(str(source)).items()}
    save_file(state, str(source / "model.safetensors"), metadata={"format": "pt"})
    H.edit_config(str(source), dtype="bfloat16")
    H.convert(source, tmp_path / "mcore", "to_mcore")
    H.convert(tmp_path / "mcore", tmp_path / "back", "to_hf")
    exported = H.safetensors_state(str(tmp_path / "back"))
    assert sorted(exported) == sorted(state)
    assert any(tensor.dtype == torch.float32 for tensor in state.values())
    for name, tensor in state.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def test_a_vision_language_folder_without_its_language_model_is_refused_by_name(tmp_path):
    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve

    folder = tmp_path / "vl"
    make(folder, "qwen3_5_text")
    text = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text, "vision_config": {"model_type": "qwen3_5_vision"}}))
    with pytest.raises(ArgumentError, match=(
            rf"^--model {folder}: a qwen3_5 folder whose weights hold no language model's "
            rf"embedding \(looked for model.language_model.embed_tokens.weight and "
            rf"language_model.model.embed_tokens.weight\)$")):
        resolve(RunArguments.from_flags(model=str(folder)), world_size=1)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["text", "vision_language"])
def test_lora_on_the_delta_nets_exports_as_peft(tmp_path, train_here, kind):
    """LoRA on the delta nets (and the attention and MLP: all-linear) of a qwen3_5_text
    folder, and of the language model of a qwen3_5 vision-language folder: the PEFT adapter
    carries in_proj's adapter on Qwen3.5's four input projections (A shared, B split into
    [queries; keys; values], z, b, a) and out_proj's, under the module names of the folder's
    transformers model (model.language_model.* in the vision-language one); peft loads it
    onto that model, which then gives the checkpoint's logits on text within 1e-4."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from test_hf_training import run_flags

    folder = tmp_path / "hf"
    if kind == "text":
        make(folder, "qwen3_5_text")
        auto, prefix = AutoModelForCausalLM, "model.layers."
    else:
        from test_multimodal_text import QWEN_VISION, make_multimodal

        make_multimodal(folder, "qwen3_5", dict(H.BASE, **HYBRID), QWEN_VISION)
        auto, prefix = AutoModelForImageTextToText, "model.language_model.layers."
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(40)))
    out = tmp_path / "lora"
    train_here(out, "--model", folder, "--dataset", data, "--seq_length", "32", "--lr", "2e-2",
               "--train_iters", "2", "--tuner_type", "lora", "--lora_rank", "4",
               command="pt", base=run_flags())
    H.convert(out / "checkpoint", tmp_path / "adapter", "to_peft")
    written = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert all(name.startswith("base_model.model." + prefix) for name in written)
    assert sorted({name.split(".linear_attn.")[1] for name in written
                   if ".linear_attn." in name}) == [
        f"{module}.lora_{ab}.weight" for module in ("in_proj_a", "in_proj_b", "in_proj_qkv",
                                                    "in_proj_z", "out_proj") for ab in "AB"]
    ids = H.tokens(length=40)
    H.check_peft_loads_the_checkpoint(
        out / "checkpoint", auto.from_pretrained(str(folder), attn_implementation="eager"),
        tmp_path / "adapter", ids)
