"""GLM-4.5 (partial rotary, q/k/v bias, per-head q/k norm, DeepSeek-V3's sigmoid router with
its expert bias, a shared expert and a dense first layer): a tiny random folder gives
transformers' logits, round-trips bit for bit, trains with sft and exports transformers'
logits, and infer gives transformers' greedy tokens."""

import json

import pytest
import torch

import hf_helpers as H
from swift_mcore.errors import ArgumentError
from test_deepseek_v3 import _train, convert

GLM = dict(n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
           moe_intermediate_size=32, n_group=4, topk_group=1, first_k_dense_replace=1,
           use_qk_norm=True, attention_bias=True, head_dim=32, routed_scaling_factor=1.5,
           num_hidden_layers=3)


def make_glm(path, **overrides):
    """Norm weights, biases and the routers' correction bias off their init values."""
    model = H.make_model(str(path), "glm4_moe", **{**GLM, **overrides})
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn(buffer.shape, generator=generator))
    model.save_pretrained(str(path))
    return model


@pytest.mark.parametrize("changes", [{}, {"use_qk_norm": False, "attention_bias": False,
                                          "rope_parameters": {"rope_type": "default",
                                                              "rope_theta": 500.0,
                                                              "partial_rotary_factor": 0.25}}])
def test_logits_match_and_round_trip_is_bit_identical(tmp_path, gloo_group, changes):
    from swift_mcore.loaded_model import forward_logits, load_model

    source = tmp_path / "hf"
    hf_model = make_glm(source, **changes)
    with torch.no_grad():  # the routing spreads: every expert is some token's choice
        hidden = torch.randn(128, 64, generator=torch.Generator().manual_seed(2))
        _, _, chosen = hf_model.model.layers[2].mlp.gate(hidden)
    assert len(set(chosen.flatten().tolist())) == 8
    ids = H.tokens()
    loaded = load_model(str(source), log=lambda line: None)
    ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    theirs = H.hf_logits(str(source), ids)
    assert (ours - theirs).abs().max() <= 1e-4
    m = loaded.config.model
    assert (m.model_type, m.moe_layer_freq, m.moe_router_num_groups) == ("glm4_moe", "[0,1,1]",
                                                                          4)
    assert m.rotary_percent == (0.25 if changes else 0.5)

    config = H.check_round_trip(source, tmp_path)
    back = tmp_path / "back"
    assert config["model_type"] == "glm4_moe" and config["use_qk_norm"] == (not changes)
    assert H.hf_logits(str(back), ids).sub(theirs).abs().max() == 0


def test_sft_trains_and_exports_to_transformers(tmp_path, gloo_group):
    from transformers import AutoModelForCausalLM

    from swift_mcore.arguments import SftArguments, parse_args
    from swift_mcore.loaded_model import forward_logits, load_model
    from swift_mcore.run_config import resolve
    from run_helpers import losses
    from test_hf_training import run_flags
    from test_moe_training import write_chat

    source = tmp_path / "hf"
    make_glm(source)
    data = tmp_path / "chat.jsonl"
    write_chat(data, 32)
    out = tmp_path / "sft"
    config = resolve(parse_args([*run_flags(), "--model", str(source), "--dataset", str(data),
                                 "--template", "plain", "--seq_length", "64", "--train_iters",
                                 "4", "--lr", "1e-2", "--min_lr", "1e-2", "--save_steps", "4",
                                 "--output_dir", str(out)], cls=SftArguments), world_size=1)
    assert _train(config).iteration == 4
    got = losses(out)
    assert got[4] < got[1], got
    back = tmp_path / "back"
    convert(out / "checkpoint", back, "to_hf")
    hf = AutoModelForCausalLM.from_pretrained(str(back), attn_implementation="eager").eval()
    ids = H.tokens()
    loaded = load_model(str(out / "checkpoint"), log=lambda line: None)
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (forward_logits(loaded.model, ids)[..., : loaded.vocab] - theirs).abs().max() <= 1e-4


def test_infer_gives_transformers_greedy_tokens(tmp_path, gloo_group, capsys):
    make_glm(tmp_path / "hf")
    H.check_infer_is_greedy(tmp_path / "hf", capsys)


def test_what_megatron_cannot_express_is_named(tmp_path):
    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve

    make_glm(tmp_path / "glm")
    for change, match in [(dict(partial_rotary_factor=0, rope_parameters=None),
                           "partial_rotary_factor 0 "),
                          (dict(norm_topk_prob=False), "norm_topk_prob false"),
                          (dict(topk_group=2), "num_experts_per_tok 2 with topk_group 2")]:
        H.edit_config(str(tmp_path / "glm"), **change)
        with pytest.raises(ArgumentError, match=match):
            resolve(RunArguments.from_flags(model=str(tmp_path / "glm")), world_size=1)
        make_glm(tmp_path / "glm")
    # transformers' other name of a key (its attribute_map): read as that key; two values
    # for one key refused by both names
    config = json.loads((tmp_path / "glm" / "config.json").read_text())
    alias = {k: v for k, v in config.items() if k != "n_routed_experts"}
    (tmp_path / "glm" / "config.json").write_text(json.dumps({**alias, "num_local_experts": 8}))
    assert resolve(RunArguments.from_flags(model=str(tmp_path / "glm")),
                   world_size=1).model.num_experts == 8
    (tmp_path / "glm" / "config.json").write_text(json.dumps({**config, "num_local_experts": 4}))
    with pytest.raises(ArgumentError, match=r"num_local_experts 4 and n_routed_experts 8 \(two "
                                            r"names of one value in transformers' glm4_moe"):
        resolve(RunArguments.from_flags(model=str(tmp_path / "glm")), world_size=1)
    (tmp_path / "glm" / "config.json").write_text(json.dumps(config))
    # head_dim null: transformers' attention cannot be built (its RoPE would take the
    # default); refused by name, and the weights' check names the folder, not a traceback
    config = json.loads((tmp_path / "glm" / "config.json").read_text())
    (tmp_path / "glm" / "config.json").write_text(json.dumps({**config, "head_dim": None}))
    with pytest.raises(ArgumentError, match=r"head_dim null \(a number, or no head_dim key"):
        resolve(RunArguments.from_flags(model=str(tmp_path / "glm")), world_size=1)
    from swift_mcore.models.hf_load import expected_hf_shapes

    with pytest.raises(ArgumentError, match=r"glm: transformers cannot build the model .*"
                                            r"config\.json describes \(TypeError: "):
        expected_hf_shapes(str(tmp_path / "glm"))


@pytest.mark.slow
def test_lora_on_attention_and_experts_trains_and_merges(tmp_path, train_here):
    """LoRA (all linear layers: attention, the dense MLP, every routed and shared expert)
    on a GLM-4.5 folder trains, and its merged export gives our logits in transformers."""
    from swift_mcore.loaded_model import forward_logits, load_model
    from test_hf_training import run_flags
    from test_lora_moe import LORA

    source = tmp_path / "hf"
    make_glm(source)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(100)))
    out = tmp_path / "run"
    train_here(out, "--model", source, "--dataset", data, "--train_iters", "3",
               "--save_steps", "3", "--lr", "1e-2", *LORA, command="pt", base=run_flags())
    checkpoint = out / "checkpoint" / "iter_0000003"
    merged = tmp_path / "merged"
    convert(checkpoint, merged, "to_hf", merge_lora=True)
    tokens = H.tokens(vocab=300, length=32)
    loaded = load_model(str(checkpoint), log=lambda line: None)
    ours = forward_logits(loaded.model, tokens)[..., : loaded.vocab]
    merged_logits = H.hf_logits(str(merged), tokens)
    assert (merged_logits - ours).abs().max() < 1e-4
    assert (merged_logits - H.hf_logits(str(source), tokens)).abs().max() > 1e-2
    adapted = H.safetensors_state(str(merged))["model.layers.1.mlp.experts.3.up_proj.weight"]
    assert not torch.equal(adapted, H.safetensors_state(str(source))[
        "model.layers.1.mlp.experts.3.up_proj.weight"])


def test_a_folder_without_shared_experts_loads_and_exports(tmp_path, gloo_group):
    """n_shared_experts 0: transformers saves the shared expert as tensors of no numbers;
    they are nothing to load, and the export (without them) gives transformers' logits."""
    from swift_mcore.loaded_model import forward_logits, load_model

    source, back = tmp_path / "hf", tmp_path / "back"
    make_glm(source, n_shared_experts=0, num_hidden_layers=2)
    assert 0 in H.safetensors_state(str(source))[
        "model.layers.1.mlp.shared_experts.down_proj.weight"].shape
    ids = H.tokens(length=32)
    theirs = H.hf_logits(str(source), ids)
    loaded = load_model(str(source), log=lambda line: None)
    assert loaded.config.model.moe_shared_expert_intermediate_size is None
    assert (forward_logits(loaded.model, ids)[..., : loaded.vocab] - theirs).abs().max() <= 1e-4
    convert(source, tmp_path / "mcore", "to_mcore")
    convert(tmp_path / "mcore", back, "to_hf")
    assert json.loads((back / "config.json").read_text())["n_shared_experts"] == 0
    assert (H.hf_logits(str(back), ids) - theirs).abs().max() == 0
