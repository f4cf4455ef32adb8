"""Sizes no machine can hold are refused before memory is taken: a tampered config.json in a
Hugging Face folder, a tampered args.json in a checkpoint, huge flags and --moe_layer_freq
expressions. Each command runs as a user would start it, in a subprocess under an
address-space limit (so a regression fails instead of eating the machine), and must end
with exit code 2, one line naming the field and the estimate, and nothing written."""

import json
import os
import resource
import shutil
import subprocess
import sys

import pytest

import hf_helpers as H
from run_helpers import ROOT, TINY, child_env, run_pt
from swift_mcore.arguments import RunArguments

# a tiny Qwen2.5-VL vision tower (2 blocks of 32 channels, merged into hidden 64)
VL_TOWER = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                patch_size=4, spatial_merge_size=2, window_size=16, fullatt_block_indexes=[1])
VL3_TOWER = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                 patch_size=4, spatial_merge_size=2, num_position_embeddings=16,
                 deepstack_visual_indexes=[0])
LIMIT = 4_000_000_000  # bytes of address space a refused command may take (torch: ~1.5 GB)


def _limit():
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def cli(*args, timeout=240):
    """swift-mcore ARGS in a child limited to LIMIT bytes of address space."""
    return subprocess.run([sys.executable, "-m", "swift_mcore", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=child_env(), preexec_fn=_limit)


def snapshot(path):
    """(relative path, size, mtime) of every file under ``path``."""
    found = []
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            stat = os.stat(full)
            found.append((os.path.relpath(full, path), stat.st_size, stat.st_mtime_ns))
    return sorted(found)


def assert_refused(proc, *parts):
    """Exit code 2, no traceback, one error line holding every one of ``parts``."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("sizes") / "llama"
    H.make_family(str(path), "llama")
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A one-iteration TINY run's checkpoint folder."""
    out = tmp_path_factory.mktemp("sizes") / "run"
    run_pt(out, "--train_iters", "1")
    folder = out / "checkpoint" / "iter_0000001"
    assert (folder / "args.json").exists()
    return folder


PT = ["--train_iters", "1", "--lr_warmup_iters", "0", "--seq_length", "32",
      "--global_batch_size", "1", "--micro_batch_size", "1"]


@pytest.mark.parametrize("key, value, flag", [
    ("num_hidden_layers", 100_000, "--num_layers 100000 (num_hidden_layers in"),
    ("hidden_size", 10**9, "--hidden_size 1000000000 (hidden_size in"),
    ("vocab_size", 10**10, "--vocab_size 10000000000 (vocab_size in"),
    ("intermediate_size", 10**11, "--ffn_hidden_size 100000000000 (intermediate_size in"),
])
def test_tampered_config_json_is_refused_before_building(llama, tmp_path, key, value, flag):
    model = tmp_path / "model"
    shutil.copytree(llama, model)
    H.edit_config(str(model), **{key: value})
    before = snapshot(model)
    out = tmp_path / "out"
    proc = cli("pt", "--model", model, *PT, "--output_dir", out)
    assert_refused(proc, flag, "makes the model too large for this machine", "needs at least",
                   "parameters")
    assert not out.exists()
    assert snapshot(model) == before


@pytest.mark.parametrize("flags, named", [
    (["--num_layers", "100000"], "--num_layers 100000 "),
    (["--hidden_size", "1000000000"], "--hidden_size 1000000000 "),
    (["--ffn_hidden_size", "100000000000"], "--ffn_hidden_size 100000000000 "),
    (["--kv_channels", "100000000000"], "--kv_channels 100000000000 "),
    (["--vocab_size", "10000000000"], "--vocab_size 10000000000 "),
    (["--make_vocab_size_divisible_by", "10000000000"],
     "--make_vocab_size_divisible_by 10000000000 "),
    (["--seq_length", "100000000"], "--seq_length 100000000 "),
    (["--num_experts", "100000000"], "--num_experts 100000000 "),
    (["--tuner_type", "lora", "--lora_rank", "100000000"], "--lora_rank 100000000 "),
])
def test_huge_flags_are_refused_before_building(tmp_path, flags, named):
    out = tmp_path / "out"
    proc = cli("pt", *TINY, "--train_iters", "1", *flags, "--output_dir", out)
    assert_refused(proc, named, "needs at least", "more than")
    assert not out.exists()


@pytest.mark.parametrize("freq", ["([1]*1000000)*1000000", "[1]*2" + "*1000" * 6,
                                  "[1]" + "+[1]" * 30_000, "(" * 150 + "[1]*2" + ")" * 150])
def test_moe_layer_freq_expressions_are_bounded(tmp_path, freq):
    out = tmp_path / "out"
    proc = cli("pt", *TINY, "--train_iters", "1", "--num_experts", "4",
               "--moe_layer_freq", freq, "--output_dir", out)
    assert_refused(proc, "--moe_layer_freq takes an integer k >= 1 or a list of 2 0/1 values")
    assert not out.exists()


@pytest.mark.parametrize("command", [
    ["export", "--to_hf", "--output_dir", "{out}"],
    ["infer", "--prompt", "hello", "--max_new_tokens", "2"],
])
@pytest.mark.parametrize("field, value", [("num_layers", 100_000), ("hidden_size", 10**9),
                                          ("vocab_size", 10**10)])
def test_tampered_args_json_is_refused_on_export_and_infer(checkpoint, tmp_path, command,
                                                           field, value):
    folder = tmp_path / "iter_0000001"
    shutil.copytree(checkpoint, folder)
    args_path = folder / "args.json"
    saved = json.loads(args_path.read_text())
    saved["model"][field] = value
    args_path.write_text(json.dumps(saved))
    reseal(folder)  # as an attacker would: the checksums pass
    before = snapshot(folder)
    out = tmp_path / "out"
    proc = cli(command[0], "--model", folder, *[a.format(out=out) for a in command[1:]])
    assert_refused(proc, f"--{field} {value} ", "needs at least", "for its weights")
    assert not out.exists()
    assert snapshot(folder) == before


def reseal(folder) -> None:
    """The manifest's sizes and CRCs recomputed for the files as they are now."""
    from swift_mcore.checkpointing import commit

    manifest = json.loads((folder / commit.MANIFEST_FILENAME).read_text())
    manifest["files"] = {}
    for rel in commit.list_files(str(folder)):
        if rel != commit.MANIFEST_FILENAME:
            size, crc = commit.checksum(str(folder / rel))
            manifest["files"][rel] = {"size": size, "crc32": crc}
    commit.write_manifest(str(folder), manifest)


def test_parameter_count_equals_the_built_models(gloo_group):
    """The estimate counts what megatron builds: dense, MoE (shared, gated) and LoRA."""
    from swift_mcore.models import footprint, lora
    from swift_mcore.models.gpt import build_model
    from swift_mcore.run_config import resolve

    cases = [
        dict(),
        dict(num_experts=4, moe_ffn_hidden_size=48, moe_layer_freq="[0,1]",
             moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True,
             moe_router_pre_softmax=True, moe_router_topk=1),
        dict(untie_embeddings_and_output_weights=False, add_qkv_bias=True, qk_layernorm=True,
             kv_channels=8),
        dict(tuner_type="lora", lora_rank=4, target_modules=["linear_qkv", "linear_proj"]),
        # DeepSeek-V3: multi-latent attention with and without the query LoRA, ungated
        # shared experts, a sigmoid router with its expert bias (a buffer, not counted)
        dict(multi_latent_attention=True, qk_layernorm=True, q_lora_rank=24, kv_lora_rank=16,
             qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=12,
             num_experts=4, moe_ffn_hidden_size=16, moe_layer_freq="[0,1]",
             moe_shared_expert_intermediate_size=32, moe_router_score_function="sigmoid",
             moe_router_enable_expert_bias=True),
        dict(multi_latent_attention=True, qk_layernorm=True, kv_lora_rank=16, qk_head_dim=8,
             qk_pos_emb_head_dim=4, v_head_dim=12),
        # LoRA on MLA's projections: all of them, or some (the query's direct one)
        dict(multi_latent_attention=True, qk_layernorm=True, q_lora_rank=24, kv_lora_rank=16,
             qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=12, tuner_type="lora",
             lora_rank=4),
        dict(multi_latent_attention=True, qk_layernorm=True, kv_lora_rank=16, qk_head_dim=8,
             qk_pos_emb_head_dim=4, v_head_dim=12, tuner_type="lora", lora_rank=4,
             target_modules=["linear_q_proj", "linear_kv_up_proj", "linear_proj"]),
        # multi-token prediction: two MTP layers like the last decoder layer (MoE, MLA)...
        dict(multi_latent_attention=True, qk_layernorm=True, q_lora_rank=24, kv_lora_rank=16,
             qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=12,
             num_experts=4, moe_ffn_hidden_size=16, moe_layer_freq="[0,1]",
             moe_shared_expert_intermediate_size=32, moe_router_score_function="sigmoid",
             moe_router_enable_expert_bias=True, mtp_num_layers=2),
        # ... and dense, with LayerNorm (two parameters per norm) and tied embeddings
        dict(mtp_num_layers=1, normalization="LayerNorm",
             untie_embeddings_and_output_weights=False),
        # ... with LoRA: the MTP layer's transformer layer adapted as the decoder's, its
        # eh_proj when named
        dict(mtp_num_layers=2, tuner_type="lora", lora_rank=4),
        dict(mtp_num_layers=1, tuner_type="lora", lora_rank=4,
             target_modules=["linear_qkv", "eh_proj"]),
        dict(model_type="gemma3", window_size=8, window_attn_skip_freq="2", kv_channels=8,
             rotary_base_local=10000, softmax_scale=0.25),
        # Qwen3-Next: a delta-net layer and a gated-attention layer, a gated shared expert
        dict(model_type="qwen3_next", linear_attention_freq="[1,0]", attention_output_gate=True,
             qk_layernorm=True, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=3,
             num_experts=4, moe_ffn_hidden_size=16, moe_layer_freq="[1,0]",
             moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True),
        # ... with its MTP layer: full attention although the decoder's last is a delta net
        dict(model_type="qwen3_next", linear_attention_freq="[0,1]", attention_output_gate=True,
             qk_layernorm=True, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=3,
             num_experts=4, moe_ffn_hidden_size=16, moe_layer_freq="[0,1]",
             moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True,
             mtp_num_layers=1),
        # ... LoRA on every linear: the delta nets' in_proj/out_proj, the attention's own
        dict(model_type="qwen3_next", linear_attention_freq="[1,0]", attention_output_gate=True,
             qk_layernorm=True, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=3,
             tuner_type="lora", lora_rank=4),
        # delta-net layers in a model of no family: plain norms, attention without the gate
        dict(linear_attention_freq="2", rotary_percent=0.5),
        # a reward model: the score head [1, hidden] in place of the LM head, tied or not
        dict(num_labels=1),
        dict(num_labels=1, untie_embeddings_and_output_weights=False),
        # gpt-oss: attention sinks, q/k/v/o biases, router and expert biases, the clamped
        # SwiGLU (gated without --swiglu); then expert biases in a dense + MoE model
        dict(model_type="gpt_oss", swiglu=False, add_bias_linear=True, add_qkv_bias=True,
             softmax_type="learnable", activation_func_clamp_value=7.0, window_size=8,
             window_attn_skip_freq="[1,0]", num_experts=4, moe_ffn_hidden_size=16,
             rope_type="yarn", rotary_scaling_factor=4.0, yarn_truncate=False),
        dict(add_bias_linear=True, num_experts=4, moe_ffn_hidden_size=16,
             moe_layer_freq="[0,1]"),
        # Qwen2.5-VL: transformers' vision tower and merger inside the model
        dict(model_type="qwen2_5_vl", add_qkv_bias=True, position_embedding_type="mrope",
             mrope_section="[2,3,3]", vision_config=json.dumps({"image_token_id": 290,
                                                                "vision_config": VL_TOWER})),
        # Qwen3-VL: the tower with its deepstack merger, Qwen3's q/k norms
        dict(model_type="qwen3_vl", qk_layernorm=True, position_embedding_type="mrope",
             mrope_section="[2,3,3]", vision_config=json.dumps({"image_token_id": 290,
                                                                "vision_config": VL3_TOWER})),
        dict(model_type="qwen3_vl_moe", qk_layernorm=True, position_embedding_type="mrope",
             mrope_section="[2,3,3]", vision_config=json.dumps({"image_token_id": 290,
                                                                "vision_config": VL3_TOWER}),
             num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2),
        # LoRA on the tower's and mergers' linear layers too; on the tower's alone
        dict(model_type="qwen3_vl", qk_layernorm=True, position_embedding_type="mrope",
             mrope_section="[2,3,3]", vision_config=json.dumps({"image_token_id": 290,
                                                                "vision_config": VL3_TOWER}),
             tuner_type="lora", freeze_vit=False, freeze_aligner=False),
        dict(model_type="qwen2_5_vl", add_qkv_bias=True, position_embedding_type="mrope",
             mrope_section="[2,3,3]", vision_config=json.dumps({"image_token_id": 290,
                                                                "vision_config": VL_TOWER}),
             tuner_type="lora", freeze_vit=False, freeze_llm=True),
    ]
    from megatron.core import tensor_parallel

    # megatron's GatedDeltaNet initializes dt_bias and A_log under the RNG tracker, which a
    # run seeds (runtime/seed.py)
    tensor_parallel.model_parallel_cuda_manual_seed(0, inference_rng_tracker=True,
                                                    force_reset_rng=True)
    for changes in cases:
        flags = RunArguments.from_flags(
            num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
            seq_length=32, vocab_size=300, train_iters=10, lr_warmup_iters=0, **changes)
        config = resolve(flags, world_size=1, cuda=False).complete(300, None)
        model = lora.apply(config, build_model(config))[0]
        built = sum(p.numel() for p in model.parameters())
        assert sum(footprint.parameter_counts(config.model, config.tuner).values()) == built, \
            changes


def test_conversion_needs_room_for_the_weights_alone(llama, tmp_path, monkeypatch, gloo_group):
    """export --to_mcore and --to_hf never train: on a machine with room for the weights
    but not for training (1.5x the weights), both directions convert."""
    from swift_mcore.models import footprint

    real_parts, weights = footprint.parts, []

    def parts(flags, world_size, precision, weights_only=False, cuda=False):
        found = real_parts(flags, world_size, precision, weights_only, cuda)
        if weights_only:
            weights.append(sum(part.bytes for part in found))
        return found

    monkeypatch.setattr(footprint, "parts", parts)
    monkeypatch.setattr(footprint, "available",
                        lambda cuda, ranks: (int(1.5 * weights[0]), "a small machine"))
    H.convert(llama, tmp_path / "mcore", "to_mcore")
    H.convert(tmp_path / "mcore", tmp_path / "back", "to_hf")
    original, back = H.safetensors_state(str(llama)), H.safetensors_state(str(tmp_path / "back"))
    assert sorted(back) == sorted(original)


def test_the_distributed_optimizer_shards_the_experts_over_expert_data_parallel():
    """megatron's expert optimizer shards its state over the expert-data-parallel ranks
    (world / (EP x TP x PP)): at EP=2 on 2 ranks nothing of the experts' is sharded, while
    the dense layers' 12 optimizer bytes per parameter are split in two."""
    from swift_mcore.models import footprint
    from swift_mcore.run_config import resolve

    def sizes(world, **flags):
        args = RunArguments.from_flags(
            num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
            vocab_size=300, num_experts=4, moe_ffn_hidden_size=32, micro_batch_size=1,
            global_batch_size=4, expert_model_parallel_size=2, **flags)
        return {part.name: part for part in footprint.parts(
            resolve(args, world_size=world, cuda=False), world, "fp32", False)}

    plain, two, four = (sizes(2), sizes(2, use_distributed_optimizer=True),
                        sizes(4, use_distributed_optimizer=True))
    experts = -(-plain["experts"].parameters // 2)  # each EP rank's half
    assert plain["experts"].bytes == two["experts"].bytes == experts * 16
    assert four["experts"].bytes == experts * (4 + 6)
    layers = plain["layers"].parameters
    assert (plain["layers"].bytes, two["layers"].bytes) == (layers * 16, layers * (4 + 6))
