"""The family registry: config.json -> model flags (both RoPE spellings), flags -> config.json,
and which family a checkpoint trained from scratch exports as."""

import pytest

import hf_helpers as H
from swift_mcore.errors import ArgumentError
from swift_mcore.arguments import RunArguments
from swift_mcore.models import families
from swift_mcore.run_config import resolve


def flags_from(path, **extra):
    args = RunArguments.from_flags(model=str(path), **extra)
    return resolve(args, world_size=1, cuda=False).model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    for family in H.FAMILIES:
        H.make_family(str(root / family), family, tokenizer=False)
    return root


def test_every_family_is_registered_from_its_own_file():
    assert {"llama", "qwen2", "qwen3", "mistral"} <= set(families.families())


def test_config_values_reach_the_model_flags(folders):
    llama = flags_from(folders / "llama")
    assert (llama.model_type, llama.num_layers, llama.hidden_size, llama.ffn_hidden_size,
            llama.num_attention_heads, llama.num_query_groups, llama.kv_channels,
            llama.vocab_size, llama.max_position_embeddings) == (
        "llama", 2, 64, 96, 4, 2, 16, 320, 256)
    assert llama.norm_epsilon == 1e-6  # transformers' default, not megatron's 1e-5
    assert llama.untie_embeddings_and_output_weights and not llama.use_rope_scaling
    assert llama.make_vocab_size_divisible_by == 1  # the embedding keeps the config's rows
    assert flags_from(folders / "qwen2").add_qkv_bias
    assert not flags_from(folders / "qwen2").untie_embeddings_and_output_weights
    qwen3 = flags_from(folders / "qwen3")
    assert qwen3.qk_layernorm and qwen3.kv_channels == 32 and not qwen3.add_qkv_bias
    assert flags_from(folders / "mistral").norm_epsilon == 1e-5
    llama3 = flags_from(folders / "llama3")
    assert (llama3.use_rope_scaling, llama3.rope_scaling_factor, llama3.rotary_base) == (
        True, 8.0, 500000)


def test_older_rope_spelling_and_architectures_fallback(folders, tmp_path):
    import shutil

    legacy = tmp_path / "legacy"
    shutil.copytree(folders / "llama3", legacy)
    H.edit_config(str(legacy), rope_parameters=None, rope_theta=500000.0, model_type=None,
                  rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192})
    m = flags_from(legacy)
    assert (m.model_type, m.use_rope_scaling, m.rotary_base) == ("llama", True, 500000)


@pytest.mark.parametrize("family", list(H.FAMILIES))
def test_exported_config_reads_back_to_the_same_flags(folders, family):
    m = flags_from(folders / family)
    fam = families.for_model_args(m)
    assert fam.name == m.model_type
    config = {"model_type": fam.model_types[0], **fam.hf_config(m, m.vocab_size)}
    again = fam.model_values(config, m)
    assert all(getattr(m, k) == v for k, v in again.items()), family


def test_family_of_a_model_trained_from_scratch():
    def family(**flags):
        args = RunArguments.from_flags(**flags)
        return families.for_model_args(resolve(args, world_size=1, cuda=False).model).name

    assert family() == "llama"
    assert family(add_qkv_bias=True) == "qwen2"
    assert family(qk_layernorm=True) == "qwen3"
    assert family(model_type="mistral") == "mistral"
    with pytest.raises(ArgumentError, match="--normalization 'LayerNorm'"):
        family(normalization="LayerNorm")
    with pytest.raises(ArgumentError, match="--add_qkv_bias True \\(a qwen3 model has False\\)"):
        family(model_type="qwen3", add_qkv_bias=True)


def test_every_key_a_family_reads_has_declared_values():
    from swift_mcore.models.families import families
    from swift_mcore.models.families.base import VALUES

    for family in families().values():
        assert not family.read_keys() - set(VALUES), family.name


@pytest.mark.parametrize("model_type, family", [
    ("gemma3_text", "gemma3"), ("qwen3_next", "qwen3_next"), ("qwen3_5_text", "qwen3_5"),
    ("qwen3_5_moe_text", "qwen3_5_moe")])
def test_a_config_of_few_keys_reads_as_transformers_defaults_it(model_type, family):
    """Keys a config.json leaves out, the sizes and vocabulary included, are transformers'
    defaults (the Hub's Gemma 3 text_config names five keys: it was refused as lacking
    num_attention_heads and vocab_size)."""
    from transformers import AutoConfig

    config = {"model_type": model_type, **({"num_experts": 16} if family != "gemma3" and
                                            family != "qwen3_5" else {})}
    values = families.by_name(family).model_values(config, None)
    hf = AutoConfig.for_model(model_type, **{k: v for k, v in config.items()
                                             if k != "model_type"})
    assert (values["vocab_size"], values["hidden_size"], values["num_layers"],
            values["num_attention_heads"], values["num_query_groups"], values["kv_channels"],
            values.get("moe_router_topk")) == (
        hf.vocab_size, hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads,
        hf.num_key_value_heads, hf.head_dim, getattr(hf, "num_experts_per_tok", None))
    if getattr(hf, "intermediate_size", None) is not None:
        assert values["ffn_hidden_size"] == hf.intermediate_size


def test_the_hubs_gemma3_multimodal_config_reads_as_transformers_reads_it():
    """gemma-3-4b-it's config.json: its text_config gives five keys and the global layers'
    linear RoPE scaling; the rest are Gemma3TextConfig's defaults."""
    from transformers import Gemma3Config

    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
           "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
           "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                           "model_type": "gemma3_text", "num_hidden_layers": 34,
                           "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152, "image_size": 896,
                             "intermediate_size": 4304, "model_type": "siglip_vision_model",
                             "num_attention_heads": 16, "num_hidden_layers": 27,
                             "patch_size": 14, "vision_use_head": False}}
    values = families.by_name("gemma3").model_values(hub, None)
    hf = Gemma3Config(**{k: v for k, v in hub.items() if k != "model_type"}).text_config
    rope = hf.rope_parameters
    assert (values["num_attention_heads"], values["num_query_groups"], values["kv_channels"],
            values["vocab_size"], values["softmax_scale"]) == (
        hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.vocab_size,
        hf.query_pre_attn_scalar ** -0.5)
    assert values["window_attn_skip_freq"] == "[" + ",".join(
        "1" if kind == "sliding_attention" else "0" for kind in hf.layer_types) + "]"
    assert (values["rotary_base"], values["rotary_base_local"],
            values["rotary_seq_len_interpolation_factor"]) == (
        rope["full_attention"]["rope_theta"], rope["sliding_attention"]["rope_theta"],
        rope["full_attention"]["factor"])


def _both_rope_spellings(family):
    """(config, the values transformers reads) of a ``family`` config.json holding
    rope_parameters and a different rope_scaling, as an older file beside a newer key."""
    from test_deepseek_v3 import DEEPSEEK, YARN as DEEPSEEK_YARN
    from test_glm4_moe import GLM
    from test_gpt_oss import GPT_OSS, YARN as GPT_OSS_YARN

    if family == "glm4_moe":
        own = {**GLM, "partial_rotary_factor": 0.5,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                   "partial_rotary_factor": 0.5},
               "rope_scaling": {"rope_type": "default", "rope_theta": 500.0,
                                "partial_rotary_factor": 0.25}}
    else:
        own, yarn = ((DEEPSEEK, DEEPSEEK_YARN) if family == "deepseek_v3"
                     else (GPT_OSS, GPT_OSS_YARN))
        own = {**own, "rope_parameters": yarn, "rope_scaling": {**yarn, "factor": 8.0}}
    return {**H.BASE, **own, "model_type": family}


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "gpt_oss"])
def test_rope_scaling_beside_rope_parameters_is_read_as_transformers_reads_it(family):
    """transformers takes a given rope_scaling in place of rope_parameters; these families'
    own RoPE readers took rope_parameters (other logits, silently)."""
    import transformers

    config = _both_rope_spellings(family)
    values = families.by_name(family).model_values(config, None)
    cls = transformers.AutoConfig.for_model(family).__class__
    hf = cls(**{k: v for k, v in config.items() if k != "model_type"}).rope_parameters
    if family == "glm4_moe":
        assert values["rotary_base"] == hf["rope_theta"] == 500
        assert values["rotary_percent"] == hf["partial_rotary_factor"] == 0.25
    else:
        assert values["rotary_scaling_factor"] == hf["factor"] == 8.0
