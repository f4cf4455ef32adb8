"""gpt-oss (attention sinks, a sliding-window and a full layer, YaRN without truncation, q/k/v/o
biases, a router with a bias, experts with biases and the clamped SwiGLU in transformers'
fused, interleaved tensors): a tiny random folder gives transformers' logits, round-trips
bit for bit, trains with sft, resumes exactly and exports transformers' logits, infer gives
transformers' greedy tokens, and what megatron cannot compute is refused by name."""

import json

import pytest
import torch

import hf_helpers as H
from swift_mcore.errors import ArgumentError
from test_deepseek_v3 import _train, convert

YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0}
# a window of 8 tokens over 64-token rows; a low limit, so the clamps cut
GPT_OSS = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=16,
               sliding_window=8, layer_types=["sliding_attention", "full_attention"],
               rope_parameters=YARN, swiglu_limit=1.5)


def make_gpt_oss(path, **overrides):
    """Norms, biases and sinks moved off their init values (biases and sinks start at 0)."""
    model = H.make_model(str(path), "gpt_oss", **{**GPT_OSS, **overrides})
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias") or name.endswith("sinks"):
                param.add_(0.5 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss") / "hf"
    make_gpt_oss(path)
    return path


def test_logits_match_and_round_trip_is_bit_identical(folder, tmp_path, gloo_group):
    from swift_mcore.loaded_model import forward_logits, load_model

    hf_model = make_gpt_oss(tmp_path / "same")  # the folder's model, in memory
    with torch.no_grad():  # the routing spreads: every expert is some token's choice
        hidden = torch.randn(128, 64, generator=torch.Generator().manual_seed(2))
        for layer in hf_model.model.layers:
            _, _, chosen = layer.mlp.router(hidden)
            assert len(set(chosen.flatten().tolist())) == 4
            gate_up = hidden @ layer.mlp.experts.gate_up_proj[0]
            assert (gate_up.abs() > 1.5).any()  # the clamp cuts
    ids = H.tokens()
    loaded = load_model(str(folder), log=lambda line: None)
    m = loaded.config.model
    assert (m.model_type, m.softmax_type, m.window_size, m.window_attn_skip_freq) == (
        "gpt_oss", "learnable", 8, "[1,0]")
    assert (m.rope_type, m.rotary_scaling_factor, m.yarn_truncate,
            m.activation_func_clamp_value) == ("yarn", 4.0, False, 1.5)
    ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    theirs = H.hf_logits(str(folder), ids)
    assert (ours - theirs).abs().max() <= 1e-4
    # each TP rank's heads' sinks count in the gradient norm (megatron leaves the mark out)
    sinks = [p for n, p in loaded.model.named_parameters() if n.endswith("softmax_offset")]
    assert len(sinks) == 2 and all(getattr(p, "tensor_model_parallel", False) for p in sinks)

    config = H.check_round_trip(folder, tmp_path)
    assert config["model_type"] == "gpt_oss" and config["rope_parameters"]["truncate"] is False
    assert config["layer_types"] == GPT_OSS["layer_types"] and config["swiglu_limit"] == 1.5
    assert H.hf_logits(str(tmp_path / "back"), ids).sub(theirs).abs().max() == 0


def test_what_changes_the_logits_is_mapped(folder, tmp_path, gloo_group):
    """The sinks, the window, the clamp and YaRN's truncation each change transformers'
    logits, and ours follow each (a mapping that dropped one would fail here)."""
    import shutil

    from swift_mcore.loaded_model import forward_logits, load_model

    ids = H.tokens()
    base = H.hf_logits(str(folder), ids)
    older = dict(rope_parameters=None, rope_theta=YARN["rope_theta"],  # the Hub's spelling
                 rope_scaling={k: v for k, v in YARN.items() if k != "rope_theta"})
    path = tmp_path / "older"
    shutil.copytree(folder, path)
    H.edit_config(str(path), **older)
    assert (H.hf_logits(str(path), ids) - base).abs().max() == 0
    loaded = load_model(str(path), log=lambda line: None)
    assert (forward_logits(loaded.model, ids)[..., : loaded.vocab] - base).abs().max() <= 1e-4
    changes = [dict(swiglu_limit=3.0), dict(sliding_window=4),
               dict(rope_parameters={**YARN, "truncate": True}),
               dict(layer_types=["full_attention", "sliding_attention"])]
    for i, change in enumerate(changes):
        path = tmp_path / f"changed{i}"
        shutil.copytree(folder, path)
        H.edit_config(str(path), **change)
        theirs = H.hf_logits(str(path), ids)
        assert (theirs - base).abs().max() > 1e-3, change
        loaded = load_model(str(path), log=lambda line: None)
        ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
        assert (ours - theirs).abs().max() <= 1e-4, change


def test_sft_trains_exports_and_resumes_exactly(folder, tmp_path, gloo_group):
    """`sft --model FOLDER` in this process: the loss falls, the export gives transformers'
    logits equal to ours, and a run resumed from iteration 2 repeats the losses and the
    weights (sinks and biases included) bit for bit."""
    from transformers import AutoModelForCausalLM

    from swift_mcore.arguments import SftArguments, parse_args
    from swift_mcore.loaded_model import forward_logits, load_model
    from swift_mcore.run_config import resolve
    from run_helpers import losses
    from test_hf_training import run_flags
    from test_moe_training import write_chat

    data = tmp_path / "chat.jsonl"
    write_chat(data, 32)
    out, again = tmp_path / "sft", tmp_path / "again"
    flags = [*run_flags(), "--model", str(folder), "--dataset", str(data), "--template",
             "plain", "--seq_length", "64", "--train_iters", "4", "--lr", "1e-2",
             "--min_lr", "1e-2"]
    config = resolve(parse_args([*flags, "--save_steps", "2", "--output_dir", str(out)],
                                cls=SftArguments), world_size=1)
    assert config.attention == "sdpa"
    assert _train(config).iteration == 4
    ref = losses(out)
    assert ref[4] < ref[1], ref

    back = tmp_path / "back"
    convert(out / "checkpoint", back, "to_hf")
    hf = AutoModelForCausalLM.from_pretrained(str(back), attn_implementation="eager").eval()
    ids = H.tokens()
    loaded = load_model(str(out / "checkpoint"), log=lambda line: None)
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (forward_logits(loaded.model, ids)[..., : loaded.vocab] - theirs).abs().max() <= 1e-4
    trained, initial = H.safetensors_state(str(back)), H.safetensors_state(str(folder))
    for name in ("model.layers.0.self_attn.sinks", "model.layers.1.mlp.router.bias",
                 "model.layers.1.mlp.experts.gate_up_proj_bias"):
        assert not torch.equal(trained[name], initial[name]), name  # trained

    resumed = resolve(parse_args([*flags, "--save_steps", "4", "--output_dir", str(again),
                                  "--resume", str(out / "checkpoint" / "iter_0000002")],
                                 cls=SftArguments), world_size=1)
    assert _train(resumed).iteration == 4
    got = losses(again)
    assert sorted(got) == [3, 4] and all(got[i] == ref[i] for i in got), (got, ref)
    convert(again / "checkpoint", tmp_path / "back2", "to_hf")
    repeated = H.safetensors_state(str(tmp_path / "back2"))
    assert sorted(repeated) == sorted(trained)
    for name, tensor in trained.items():
        assert torch.equal(repeated[name], tensor), name


def test_infer_gives_transformers_greedy_tokens(folder, gloo_group, capsys):
    # a prompt longer than the window: the sliding layer's window cuts during generation
    count = H.check_infer_is_greedy(folder, capsys, prompt="x = q + w * e - r / t % y",
                                    new_tokens=6)
    assert count > GPT_OSS["sliding_window"]


def test_what_megatron_cannot_express_is_named(folder, tmp_path, gloo_group):
    """Each config.json value swift-mcore cannot compute as transformers does is refused by
    its key, in one line naming what is accepted, before anything is built."""
    import shutil

    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve

    path = tmp_path / "oss"
    shutil.copytree(folder, path)
    original = json.loads((path / "config.json").read_text())

    def refused(match, world_size=1, **flags):
        with pytest.raises(ArgumentError, match=match) as err:
            resolve(RunArguments.from_flags(model=str(path), **flags), world_size=world_size)
        assert "\n" not in str(err.value)

    cases = [
        (dict(quantization_config={"quant_method": "bitsandbytes"}),
         "quantization_config quant_method 'bitsandbytes' \\(only 'mxfp4': the Hub's "
         "experts, dequantized on load; or a folder of bfloat16 or float32 weights\\)"),
        (dict(swiglu_alpha=1.0), "swiglu_alpha 1.0 \\(megatron's quick_gelu has 1.702\\)"),
        (dict(swiglu_limit="7"), "swiglu_limit '7' is a string"),
        (dict(attention_bias=False), "attention_bias false"),
        (dict(rope_parameters={**YARN, "attention_factor": 1.2}), "attention_factor"),
        (dict(rope_parameters={**YARN, "factor": 0}), r"rope_parameters\.factor 0 \(a number, "
                                                      r"above 0\)"),
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
         "rope_type 'dynamic' \\(supported: 'default', 'yarn'\\)"),
        (dict(layer_types=["sliding_attention"]), "layer_types \\['sliding_attention'\\]"),
        (dict(num_experts_per_tok=1), "num_experts_per_tok 1 with a router that always"),
    ]
    for change, match in cases:
        (path / "config.json").write_text(json.dumps({**original, **change}))
        refused(match)
    # export and infer read config.json's values before the tokenizer (transformers' reads
    # config.json too, and would blame the tokenizer)
    (path / "config.json").write_text(json.dumps({**original, "swiglu_limit": None}))
    from swift_mcore.loaded_model import load_model

    with pytest.raises(ArgumentError, match=r"config\.json describes a gpt_oss model .*: "
                                            r"swiglu_limit None \(a positive number\)"):
        load_model(str(path), log=lambda line: None)
    (path / "config.json").write_text(json.dumps(original))
    refused("--softmax_type learnable with --attention_backend transformer_engine: not "
            "tested here; use sdpa, local or auto", attention_backend="transformer_engine")
    refused("--attention_backend local with --window_size 8", attention_backend="local")
    refused(r"--mtp_num_layers 1 with a per-layer --window_attn_skip_freq \[1,0\] \(gpt-oss's "
            r"layer_types\): megatron-core 0.16.1 looks an MTP layer up", mtp_num_layers=1)
    refused("--tensor_model_parallel_size 2 with biased experts \\(--add_bias_linear: "
            "gpt-oss\\) needs --expert_tensor_parallel_size 1", world_size=2,
            tensor_model_parallel_size=2, sequence_parallel=True, global_batch_size=8)
    shape = dict(num_layers=2, hidden_size=64, num_attention_heads=4, global_batch_size=8)
    for flags, match in [
        (dict(num_experts=4, tensor_model_parallel_size=4, sequence_parallel=True,
              expert_tensor_parallel_size=2),
         r"--expert_tensor_parallel_size 2: 1 \(each expert whole on its rank\) or "
         r"--tensor_model_parallel_size \(4\)"),
        (dict(tensor_model_parallel_size=4, expert_tensor_parallel_size=1),
         "--expert_tensor_parallel_size 1 splits the experts of MoE layers; it needs "
         "--num_experts"),
        (dict(num_experts=4, expert_tensor_parallel_size=0, global_batch_size=16),
         "--expert_tensor_parallel_size"),
    ]:
        with pytest.raises(ArgumentError, match=match):
            resolve(RunArguments.from_flags(**{**shape, **flags}), world_size=4)
    with pytest.raises(ArgumentError, match="--activation_func_clamp_value is gpt-oss's"):
        resolve(RunArguments.from_flags(activation_func_clamp_value=7.0), world_size=1)
    with pytest.raises(ArgumentError, match="--rope_type yarn is multi-latent attention's "
                                            "RoPE or gpt-oss's"):
        resolve(RunArguments.from_flags(rope_type="yarn"), world_size=1)


@pytest.mark.benchmark
def test_lora_trains_merges_and_exports_attention_adapters_to_peft(folder, tmp_path,
                                                                   train_here):
    """LoRA on every linear (attention and each expert's fc1/fc2) trains; the merged export
    gives our logits in transformers; --to_peft refuses the experts' adapters in one line,
    and writes an attention-only run's adapters, which peft loads to our logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from swift_mcore.loaded_model import forward_logits, load_model
    from test_hf_training import run_flags
    from test_lora_moe import LORA

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(100)))
    tokens = H.tokens(vocab=300, length=32)
    base_logits = H.hf_logits(str(folder), tokens)
    for name, targets in (("all", []), ("attention", ["--target_modules", "linear_qkv",
                                                       "linear_proj"])):
        out = tmp_path / name
        train_here(out, "--model", folder, "--dataset", data, "--train_iters", "3",
                   "--save_steps", "3", "--lr", "1e-2", *LORA, *targets, command="pt",
                   base=run_flags())
        checkpoint = out / "checkpoint" / "iter_0000003"
        ours = forward_logits(load_model(str(checkpoint), log=lambda line: None).model,
                              tokens)[..., :320]
        assert (ours - base_logits).abs().max() > 1e-2  # the adapters trained
        merged = tmp_path / f"{name}-merged"
        convert(checkpoint, merged, "to_hf", merge_lora=True)
        assert (H.hf_logits(str(merged), tokens) - ours).abs().max() < 1e-4
    with pytest.raises(ArgumentError, match=r"--to_peft: decoder\.layers\.0\.mlp\.experts\."
                                            r"local_experts\.0\.linear_fc1 \(a gpt-oss expert\)"
                                            r" has an adapter; .* --to_hf --merge_lora"):
        convert(tmp_path / "all" / "checkpoint" / "iter_0000003", tmp_path / "peft-all",
                "to_peft")
    assert not (tmp_path / "peft-all").exists()
    adapter = tmp_path / "peft"
    convert(checkpoint, adapter, "to_peft")
    base = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                attn_implementation="eager")
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(base, str(adapter)).eval()(tokens).logits
    assert (peft_logits - ours).abs().max() < 1e-4



def test_a_tp_rank_with_whole_experts_reads_whole_experts_and_half_the_attention(folder):
    """--expert_tensor_parallel_size 1 at TP=2: TP rank 1 reads its half of the attention
    and each routed expert whole (its weights, biases, from the fused tensors)."""
    from swift_mcore.arguments import RunArguments
    from swift_mcore.models.convert import Layout
    from swift_mcore.models.hf_folder import HFFolder
    from swift_mcore.run_config import resolve

    m = resolve(RunArguments.from_flags(model=str(folder)), world_size=1).model
    layout = Layout.from_model_args(m, 320)
    with HFFolder(str(folder)).reader() as reader:
        def shard(name, tp, expert_tp):
            return layout.to_mcore(name, reader.read, *tp, 0, 1, expert_tp)

        for suffix in ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight",
                       "linear_fc2.bias"):
            name = f"decoder.layers.1.mlp.experts.local_experts.3.{suffix}"
            whole = shard(name, (0, 1), (0, 1))
            assert torch.equal(shard(name, (1, 2), (0, 1)), whole), suffix
        fc1 = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
        rows = shard(fc1, (0, 1), (0, 1)).shape[0]
        assert shard(fc1, (1, 2), (1, 2)).shape[0] == rows // 2  # expert TP = TP: halves
        qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
        assert 2 * shard(qkv, (1, 2), (0, 1)).shape[0] == shard(qkv, (0, 1), (0, 1)).shape[0]


@pytest.mark.benchmark
def test_tp2_with_whole_experts_gives_the_one_rank_logits_losses_and_export(folder, tmp_path,
                                                                            train_here):
    """TP=2 for the attention (its heads, biases and sinks split) with each expert whole on
    its rank (--expert_tensor_parallel_size 1, which expert biases need): the one-rank
    logits, the one-rank export bit for bit, and the one-rank losses."""
    from swift_mcore.loaded_model import forward_logits, load_model
    from run_helpers import losses
    from test_hf_parallel import run_two_ranks
    from test_hf_training import continue_pretraining, run_flags

    ids, out = run_two_ranks(tmp_path, folder, 2, 1, "--sequence_parallel", "--etp", "1")
    ours = torch.load(out / "logits.pt")
    loaded = load_model(str(folder), log=lambda line: None)
    one = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    # the row-parallel sums add the ranks' halves in another order: float rounding only
    assert ours.shape == one.shape
    assert (ours - one).abs().max() <= 1e-5 * one.abs().max()
    assert (ours - H.hf_logits(str(folder), ids)).abs().max() <= 1e-4
    convert(out, tmp_path / "two", "to_hf")
    original, exported = H.safetensors_state(str(folder)), H.safetensors_state(
        str(tmp_path / "two"))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(200)))
    lr = ("--lr", "1e-2", "--min_lr", "1e-2")
    train_here(tmp_path / "tp1", "--model", folder, "--dataset", data, "--no_save",
               "--train_iters", "3", *lr, command="pt", base=run_flags())
    continue_pretraining(folder, data, tmp_path / "tp2", "--no_save", "--train_iters", "3",
                         *lr, "--tensor_model_parallel_size", "2", "--sequence_parallel",
                         "--expert_tensor_parallel_size", "1", nproc=2)
    ref, got = losses(tmp_path / "tp1"), losses(tmp_path / "tp2")
    assert sorted(got) == [1, 2, 3] and ref[3] < ref[1]
    for it in ref:
        assert abs(got[it] - ref[it]) < 1e-5, (it, got[it], ref[it])


@pytest.mark.benchmark
def test_ep2_gives_the_ep1_losses(folder, tmp_path, train_here):
    """Expert parallelism: each EP rank reads its experts' slices of the fused tensors."""
    from run_helpers import losses
    from test_hf_training import continue_pretraining, run_flags

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(200)))
    one, two = tmp_path / "ep1", tmp_path / "ep2"
    train_here(one, "--model", folder, "--dataset", data, "--no_save", "--train_iters", "3",
               command="pt", base=run_flags())
    continue_pretraining(folder, data, two, "--no_save", "--train_iters", "3",
                         "--expert_model_parallel_size", "2", nproc=2)
    ref, got = losses(one), losses(two)
    assert sorted(got) == [1, 2, 3]
    for it in ref:
        assert abs(got[it] - ref[it]) < 1e-5, (it, got[it], ref[it])


MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def make_mxfp4(source, path):
    """``source``'s folder with each layer's fused expert weights replaced by random MXFP4
    blocks and scales (the Hub's gpt-oss layout), as quantization_config says."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(source, path)
    state = H.safetensors_state(str(path))
    generator = torch.Generator().manual_seed(4)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = state.pop(name).shape
        state[name + "_blocks"] = torch.randint(0, 256, (experts, outputs, inputs // 32, 16),
                                                generator=generator, dtype=torch.uint8)
        state[name + "_scales"] = torch.randint(121, 127, (experts, outputs, inputs // 32),
                                                generator=generator, dtype=torch.uint8)
    for name in [n for n in (path).iterdir() if n.name.endswith(".safetensors")]:
        name.unlink()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    H.edit_config(str(path), quantization_config=MXFP4)


def test_an_mxfp4_folder_is_dequantized_as_transformers_does(folder, tmp_path, gloo_group):
    """The Hub's MXFP4 experts: dequantized on load to transformers' own dequantization
    (Mxfp4Config(dequantize=True)) bit for bit, its logits within 1e-4; the export is the
    unquantized folder transformers would save, without quantization_config."""
    from transformers import AutoModelForCausalLM, Mxfp4Config
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from swift_mcore.loaded_model import forward_logits, load_model
    from swift_mcore.models.mxfp4 import dequantize

    source = tmp_path / "mxfp4"
    make_mxfp4(folder, source)
    stored = H.safetensors_state(str(source))
    blocks, scales = (stored[f"model.layers.1.mlp.experts.down_proj{s}"]
                      for s in ("_blocks", "_scales"))
    assert torch.equal(dequantize(blocks, scales), convert_moe_packed_tensors(
        blocks, scales, dtype=torch.float32))
    theirs_model = AutoModelForCausalLM.from_pretrained(
        str(source), quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager").eval()
    ids = H.tokens()
    with torch.no_grad():
        theirs = theirs_model(ids).logits
    loaded = load_model(str(source), log=lambda line: None)
    ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    assert (ours - theirs).abs().max() <= 1e-4
    assert (theirs - H.hf_logits(str(folder), ids)).abs().max() > 1e-2  # other experts

    checkpoint, back = tmp_path / "mcore", tmp_path / "back"
    assert convert(source, checkpoint, "to_mcore",
                   test_convert_precision=True)["max_logit_difference"] <= 1e-4
    convert(checkpoint, back, "to_hf")
    config = json.loads((back / "config.json").read_text())
    assert "quantization_config" not in config
    exported, reference = H.safetensors_state(str(back)), theirs_model.state_dict()
    assert sorted(exported) == sorted(reference)
    for name, tensor in exported.items():
        assert torch.equal(tensor, reference[name]), name
    from safetensors.torch import save_file

    state = H.safetensors_state(str(source))  # the blocks beside an unquantized tensor
    name = "model.layers.0.mlp.experts.down_proj"
    save_file({**state, name: exported[name]}, str(source / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ArgumentError, match=r"model\.safetensors: model\.layers\.0\.mlp\."
                                            r"experts\.down_proj_blocks is not part of this"):
        load_model(str(source), log=lambda line: None)
    # scales that are no MXFP4 exponents
    state["model.layers.0.mlp.experts.down_proj_scales"] = state[
        "model.layers.0.mlp.experts.down_proj_scales"].float()
    save_file(state, str(source / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ArgumentError, match=r"model\.safetensors: model\.layers\.0\.mlp\."
                                            r"experts\.down_proj: MXFP4 blocks .* scales .* "
                                            r"torch\.float32 \(uint8 \[e, out, groups, 16\]"):
        load_model(str(source), log=lambda line: None)
    with pytest.raises(ArgumentError, match="quantization_config quant_method 'fp8' \\(only "
                                            "'mxfp4'"):
        H.edit_config(str(source), quantization_config={"quant_method": "fp8"})
        load_model(str(source), log=lambda line: None)


@pytest.mark.benchmark
def test_pp2_load_matches_transformers_and_exports_bit_identical(folder, tmp_path, gloo_group):
    """PP=2: the sliding layer on the first stage and the full one on the second (the window
    pattern read by global layer number), each with its sinks, give transformers' logits;
    the checkpoint exports back bit for bit."""
    from test_hf_parallel import run_two_ranks

    ids, out = run_two_ranks(tmp_path, folder, 1, 2)
    ours = torch.load(out / "logits.pt")
    theirs = H.hf_logits(str(folder), ids)
    assert ours.shape == theirs.shape and (ours - theirs).abs().max() <= 1e-4
    exported = tmp_path / "exported"
    convert(out, exported, "to_hf")
    original, back = H.safetensors_state(str(folder)), H.safetensors_state(str(exported))
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
