"""Bad input to --model, export and infer: a clear error naming the file, key or flag, raised
before any process group exists (and, for the weights, before any tensor is read)."""

import os
import shutil

import pytest

import hf_helpers as H
from swift_mcore.errors import ArgumentError
from swift_mcore.arguments import RunArguments
from swift_mcore.run_config import resolve


def validate(**flags):
    """The RunConfig these flags resolve to (ArgumentError naming the flag, else)."""
    world = flags.pop("world_size", 1)
    return resolve(RunArguments.from_flags(**flags), world_size=world, cuda=False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "llama"
    H.make_family(str(path), "llama")
    return path


@pytest.fixture
def copy(llama, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(llama, target)
    return target


def test_missing_folder_config_and_weights(tmp_path, copy):
    with pytest.raises(ArgumentError, match=r"--model .*nope: no such folder"):
        validate(model=str(tmp_path / "nope"))
    os.remove(copy / "config.json")
    with pytest.raises(ArgumentError, match=r"no config.json in .*model"):
        validate(model=str(copy))


def test_weights_missing_or_not_safetensors(llama, tmp_path):
    folder = tmp_path / "noweights"
    shutil.copytree(llama, folder)
    os.remove(folder / "model.safetensors")
    with pytest.raises(ArgumentError, match=r"has config.json but no weights"):
        validate(model=str(folder))
    (folder / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ArgumentError, match=r"only as pytorch_model.bin; swift-mcore reads "
                                            r"safetensors"):
        validate(model=str(folder))
    (folder / "model.safetensors.index.json").write_text(
        '{"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}')
    with pytest.raises(ArgumentError, match=r"missing: model-00001-of-00002.safetensors"):
        validate(model=str(folder))


def test_a_checkpoint_given_as_model_gets_a_hint(tmp_path):
    folder = tmp_path / "run" / "checkpoint"
    folder.mkdir(parents=True)
    (folder / "latest_checkpointed_iteration.txt").write_text("3\n")
    with pytest.raises(ArgumentError, match=r"swift-mcore checkpoint: train from it with "
                                            r"--load PATH --finetune"):
        validate(model=str(folder))


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
     r"model_type 'gpt2' \(architectures \['GPT2LMHeadModel'\]\) is not supported; supported "
     r"families: .*llama \(LlamaForCausalLM\), mistral"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' \(only 'silu'"),
    ({"attention_bias": True}, r"attention_bias True \(only False\)"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}},
     r"rope_parameters.rope_type 'yarn' \(supported: 'default', 'llama3'\)"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                          "rope_theta": 10000.0}},
     r"rope_parameters.low_freq_factor 2.0 \(megatron-core's Llama-3 scaling uses 1\)"),
    ({"quantization_config": {"quant_method": "gptq"}}, r"quantization_config"),
    ({"hidden_size": None}, r"config.json lacks hidden_size"),
])
def test_unsupported_configs_name_the_key(copy, changes, message):
    H.edit_config(str(copy), **changes)
    with pytest.raises(ArgumentError, match=message):
        validate(model=str(copy))


@pytest.mark.parametrize("changes, message", [
    ({"rms_norm_eps": 0.0}, r"^--norm_epsilon must be > 0 \(a positive number\), got 0.0 "
                            r"\(from .*model/config.json\)$"),
    ({"rms_norm_eps": float("nan")}, r"^--norm_epsilon must be a finite number > 0, got nan "
                                     r"\(from .*model/config.json\)$"),
])
def test_config_values_are_checked_as_the_flags_are(copy, changes, message):
    H.edit_config(str(copy), **changes)  # json writes nan as NaN, and reads it back
    with pytest.raises(ArgumentError, match=message):
        validate(model=str(copy))


def test_qwen2_sliding_window_shorter_than_the_sequence(tmp_path):
    path = tmp_path / "qwen2"
    H.make_model(str(path), "qwen2", tokenizer=False, use_sliding_window=True,
                 sliding_window=16)
    with pytest.raises(ArgumentError, match=r"sliding_window 16 is shorter than --seq_length "
                                            r"32"):
        validate(model=str(path), seq_length=32)
    validate(model=str(path), seq_length=16)


def test_explicit_flags_that_disagree_with_config_json(llama):
    with pytest.raises(ArgumentError, match=r"config.json \(--model\) sets the model's shape, "
                                            r"and these flags disagree with it: --num_layers 3 "
                                            r"\(the config says 2\); --hidden_size 128 \(the "
                                            r"config says 64\)"):
        validate(model=str(llama), hidden_size=128, num_layers=3)
    with pytest.raises(ArgumentError, match=r"--model_type 'qwen2' disagrees"):
        validate(model=str(llama), model_type="qwen2")
    assert validate(model=str(llama), hidden_size=64).model.hidden_size == 64  # agreeing: fine


def test_parallel_sizes_that_do_not_divide_the_config(llama):
    with pytest.raises(ArgumentError, match=r"--tensor_model_parallel_size \(4\) must divide "
                                            r"--num_query_groups \(2\) \(from .*config.json\)"):
        validate(model=str(llama), tensor_model_parallel_size=4, world_size=4)
    with pytest.raises(ArgumentError, match=r"--pipeline_model_parallel_size \(3\) must divide "
                                            r"--num_layers \(2\) \(from .*config.json\)"):
        validate(model=str(llama), pipeline_model_parallel_size=3, world_size=3)


def test_weight_shapes_that_disagree_with_the_config(copy):
    from swift_mcore.models.convert import Layout
    from swift_mcore.models.hf_folder import HFFolder
    from swift_mcore.models.hf_load import check_shapes

    H.edit_config(str(copy), intermediate_size=128)
    args = validate(model=str(copy))
    with pytest.raises(ArgumentError, match=r"model.safetensors: model.layers.0.mlp.gate_proj"
                                            r".weight has shape \[96, 64\], config.json implies "
                                            r"\[128, 64\]"):
        check_shapes(HFFolder(str(copy)), Layout.from_model_args(args.model, 320))


def test_missing_and_unexpected_tensors(copy):
    import torch
    from safetensors.torch import load_file, save_file

    from swift_mcore.models.convert import Layout
    from swift_mcore.models.hf_folder import HFFolder
    from swift_mcore.models.hf_load import check_shapes

    state = load_file(copy / "model.safetensors")
    del state["model.norm.weight"]
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(state, copy / "model.safetensors", metadata={"format": "pt"})
    args = validate(model=str(copy))
    with pytest.raises(ArgumentError) as info:
        check_shapes(HFFolder(str(copy)), Layout.from_model_args(args.model, 320))
    assert "model.norm.weight: missing from the weights" in str(info.value)
    assert "model.layers.0.self_attn.q_proj.bias is not part of this model" in str(info.value)


def test_save_safetensors_needs_a_checkpoint_and_an_hf_family():
    with pytest.raises(ArgumentError, match="cannot be combined with --no_save"):
        validate(save_safetensors=True, no_save=True)
    with pytest.raises(ArgumentError, match=r"--save_safetensors: .*--swiglu False"):
        validate(save_safetensors=True, swiglu=False)


def test_export_and_infer_flags(llama, tmp_path):
    from swift_mcore.arguments.export import ExportArguments
    from swift_mcore.arguments.infer import InferArguments
    from swift_mcore.export import check_source

    def export(**flags):
        # the flags, then what --model holds (the command's check), as `export` parses them
        return check_source(ExportArguments(**flags).validate())

    with pytest.raises(ArgumentError, match="exactly one of --to_hf"):
        export(model=str(llama), output_dir=str(tmp_path / "o"))
    with pytest.raises(ArgumentError, match="is a Hugging Face folder \\(use --to_mcore\\)"):
        export(model=str(llama), output_dir=str(tmp_path / "o"), to_hf=True)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ArgumentError, match="already exists and is not empty"):
        export(model=str(llama), output_dir=str(tmp_path / "full"), to_mcore=True)
    with pytest.raises(ArgumentError, match="--max_shard_size '5 parsecs'"):
        export(model=str(llama), output_dir=str(tmp_path / "o"), to_mcore=True,
               max_shard_size="5 parsecs")
    with pytest.raises(ArgumentError, match="--prompt is required"):
        InferArguments(model=str(llama)).validate()
    with pytest.raises(ArgumentError, match=r"--top_p must be in \(0, 1\]"):
        InferArguments(model=str(llama), prompt="x", top_p=0).validate()


def test_cli_reports_bad_model_with_exit_code_2(tmp_path, capsys):
    from swift_mcore.cli import main

    assert main(["pt", "--model", str(tmp_path / "nope")]) == 2
    assert "swift-mcore pt: error: --model" in capsys.readouterr().err
    assert main(["export", "--model", str(tmp_path / "nope"), "--to_hf",
                 "--output_dir", str(tmp_path / "o")]) == 2
    assert "swift-mcore export: error: --model" in capsys.readouterr().err


# ---- hostile files in the folder (issue 35): each run as the CLI, in a subprocess with a
# timeout, so a regression that hangs (a FIFO) or crashes fails the test instead of pytest.

def export_to_mcore(model, out, timeout=180):
    import subprocess
    import sys

    from run_helpers import ROOT, child_env

    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "export", "--to_mcore",
                           "--model", str(model), "--output_dir", str(out)],
                          capture_output=True, text=True, timeout=timeout, env=child_env(),
                          cwd=ROOT)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert not os.path.exists(out), "the refused export wrote its output folder"
    return lines[-1]


def test_a_fifo_named_model_safetensors_is_refused_without_blocking(copy, tmp_path):
    weights = copy / "model.safetensors"
    os.remove(weights)
    os.mkfifo(weights)
    line = export_to_mcore(copy, tmp_path / "out", timeout=90)
    assert line == (f"swift-mcore export: error: --model {weights}: is a FIFO (named pipe), "
                    f"not a regular file; swift-mcore reads input only from regular files")


def test_a_device_linked_as_model_safetensors_is_refused(copy, tmp_path):
    weights = copy / "model.safetensors"
    os.remove(weights)
    os.symlink("/dev/zero", weights)
    line = export_to_mcore(copy, tmp_path / "out", timeout=90)
    assert line == (f"swift-mcore export: error: --model {weights}: is a character device, "
                    f"not a regular file; swift-mcore reads input only from regular files")


def test_an_index_naming_a_file_outside_the_folder_is_refused(copy, tmp_path):
    import json

    names = list(H.safetensors_state(str(copy)))
    index = copy / "model.safetensors.index.json"
    weight_map = {name: "model.safetensors" for name in names}
    weight_map[names[0]] = "../../../../etc/passwd"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    line = export_to_mcore(copy, tmp_path / "out")
    assert line == (f"swift-mcore export: error: {index}: {names[0]}: names "
                    f"'../../../../etc/passwd', a path outside its folder {copy}; only files "
                    f"inside the folder are read")


def test_a_truncated_safetensors_file_is_one_line_naming_it(copy, tmp_path):
    weights = copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])
    line = export_to_mcore(copy, tmp_path / "out")
    assert line.startswith(f"swift-mcore export: error: --model {weights}: not a readable "
                           f"safetensors file ("), line


def test_nan_in_the_weights_is_refused_naming_the_tensor(copy, tmp_path):
    from safetensors.torch import save_file

    state = H.safetensors_state(str(copy))
    name = "model.layers.1.mlp.down_proj.weight"
    state[name][3, 5] = float("nan")
    save_file(state, str(copy / "model.safetensors"), metadata={"format": "pt"})
    line = export_to_mcore(copy, tmp_path / "out")
    assert line == (f"swift-mcore export: error: --model {copy / 'model.safetensors'}: the "
                    f"weights are not finite ({name} holds 1 nan of "
                    f"{state[name].numel()} values); nothing was trained or written")


def test_a_tied_config_with_its_own_lm_head_is_refused(copy, tmp_path, gloo_group):
    """tie_word_embeddings true beside an lm_head.weight of other values: transformers unties
    them (its logits use the head), so using the embedding would give other numbers."""
    import json

    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    line = export_to_mcore(copy, tmp_path / "out")
    assert line == (f"swift-mcore export: error: --model {copy / 'model.safetensors'}: "
                    f"lm_head.weight differs from model.embed_tokens.weight, but "
                    f"{copy / 'config.json'} says tie_word_embeddings true (transformers then "
                    f"unties them; swift-mcore would use the embedding): set "
                    f"tie_word_embeddings false to keep the head")
    from safetensors.torch import save_file  # the same values there: the tied model

    state = H.safetensors_state(str(copy))
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(copy / "model.safetensors"), metadata={"format": "pt"})
    H.convert(copy, tmp_path / "out2", "to_mcore")


def test_a_config_json_nested_100000_deep_is_refused(copy):
    config = copy / "config.json"
    config.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ArgumentError, match=rf"^{config}: JSON nested 100001 levels deep"):
        validate(model=str(copy))


@pytest.mark.parametrize("changes, message", [
    ({"head_dim": 0}, r"has values no llama model has: head_dim 0 \(at least 1\)$"),
    ({"num_key_value_heads": 0}, r"num_key_value_heads 0 \(at least 1\)$"),
    ({"torch_dtype": "int8"}, r"torch_dtype 'int8' \(the weights' floating-point type: "
                              r"bfloat16, float16, float32, float64"),
    ({"hidden_size": "64"}, r"hidden_size '64' is a string \(write the number without "
                            r"quotes\)$"),
    ({"intermediate_size": "96.5", "vocab_size": "abc"},
     r"intermediate_size '96.5' is a string .*; vocab_size 'abc' is a string"),
    ({"tie_word_embeddings": "no"}, r"tie_word_embeddings 'no' \(true or false\)$"),
    ({"num_hidden_layers": 10**12}, r"num_hidden_layers 1000000000000 \(at most 1_000_000\)$"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "x"}},
     r"rope_parameters.rope_theta 'x' \(a positive number\)"),
])
def test_config_values_no_model_has_are_refused_by_key(copy, changes, message):
    H.edit_config(str(copy), **changes)
    with pytest.raises(ArgumentError, match=message):
        validate(model=str(copy))


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "qwen2_moe"
    H.make_model(str(path), "qwen2_moe", tokenizer=False, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, shared_expert_intermediate_size=48)
    return path


@pytest.mark.parametrize("changes, message", [
    ({"shared_expert_intermediate_size": 0}, r"shared_expert_intermediate_size 0 \(at least 1\)"),
    ({"decoder_sparse_step": 0}, r"decoder_sparse_step 0 \(at least 1\)"),
    ({"mlp_only_layers": ["a"]}, r"mlp_only_layers \['a'\] \(a list of integers\)"),
    ({"num_experts": "4"}, r"num_experts '4' is a string"),
    ({"norm_topk_prob": True, "num_experts_per_tok": 1},
     r"num_experts_per_tok 1 with norm_topk_prob true \(the one expert's weight is always 1"),
])
def test_moe_config_values_are_refused_by_key(qwen2_moe, tmp_path, changes, message):
    target = tmp_path / "model"
    shutil.copytree(qwen2_moe, target)
    H.edit_config(str(target), **changes)
    with pytest.raises(ArgumentError, match=message):
        validate(model=str(target), seq_length=32)


def test_moe_keys_a_config_omits_take_transformers_defaults(qwen2_moe, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(qwen2_moe, target)
    H.edit_config(str(target), num_experts_per_tok=None, moe_intermediate_size=None)
    m = validate(model=str(target), seq_length=32).model
    assert (m.moe_router_topk, m.moe_ffn_hidden_size) == (4, 1408)


def test_switch_style_top1_from_config_json_is_representable(qwen2_moe, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(qwen2_moe, target)
    H.edit_config(str(target), num_experts_per_tok=1)  # norm_topk_prob false
    m = validate(model=str(target), seq_length=32).model
    assert (m.moe_router_topk, m.moe_router_pre_softmax) == (1, True)
