"""Each family: a tiny random HF model loads into megatron with the same logits (fp32, eager
attention), and HF -> swift-mcore checkpoint -> HF gives bit-identical safetensors."""

import json

import pytest
import torch

import hf_helpers as H


def convert(source, out, direction, **flags):
    from swift_mcore.arguments.export import ExportArguments
    from swift_mcore.export import run

    args = ExportArguments(model=str(source), output_dir=str(out), **{direction: True}, **flags)
    return run(args.validate(), log=lambda line: None)


def megatron_logits(path, ids):
    from swift_mcore.loaded_model import forward_logits, load_model

    loaded = load_model(str(path), log=lambda line: None)
    return forward_logits(loaded.model, ids)[..., : loaded.vocab], loaded


@pytest.mark.parametrize("family", list(H.FAMILIES))
def test_logits_match_and_round_trip_is_bit_identical(tmp_path, gloo_group, family):
    source = tmp_path / "hf"
    H.make_family(str(source), family)
    ids = H.tokens()
    ours, loaded = megatron_logits(source, ids)
    theirs = H.hf_logits(str(source), ids)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() <= 1e-4, family
    assert loaded.config.model.model_type == H.FAMILIES[family][0]

    checkpoint = tmp_path / "mcore"
    convert(source, checkpoint, "to_mcore")
    back = tmp_path / "back"
    written = convert(checkpoint, back, "to_hf", max_shard_size="100KB")
    assert written["shards"] > 1
    original, exported = H.safetensors_state(str(source)), H.safetensors_state(str(back))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original)
    assert sorted(set(index["weight_map"].values())) == sorted(
        p.name for p in back.glob("model-*-of-*.safetensors"))
    config = json.loads((back / "config.json").read_text())
    assert config["model_type"] == H.FAMILIES[family][0]
    assert (back / "tokenizer.json").is_file()


def test_precision_check_prints_the_largest_logit_difference(tmp_path, gloo_group):
    source = tmp_path / "hf"
    H.make_family(str(source), "qwen3")
    lines = []
    from swift_mcore.arguments.export import ExportArguments
    from swift_mcore.export import run

    result = run(ExportArguments(model=str(source), output_dir=str(tmp_path / "mcore"),
                                 to_mcore=True, test_convert_precision=True).validate(),
                 log=lines.append)
    assert 0 <= result["max_logit_difference"] <= 1e-4
    assert any(line.startswith("test_convert_precision: max |logit difference|")
               for line in lines)


def test_plain_qkv_concatenation_would_be_caught(tmp_path, gloo_group, monkeypatch):
    """The logits comparison is sensitive: [q; k; v] without the per-group interleave fails."""
    from swift_mcore.models import convert as convert_module

    def concatenated(self, prefix, kind, read, tp_rank, tp_size):
        return torch.cat([read(prefix + f"self_attn.{p}_proj.{kind}") for p in "qkv"])

    source = tmp_path / "hf"
    H.make_family(str(source), "llama")
    monkeypatch.setattr(convert_module.Layout, "_qkv_shard", concatenated)
    ids = H.tokens()
    ours, _ = megatron_logits(source, ids)
    assert (ours - H.hf_logits(str(source), ids)).abs().max() > 1e-2


def test_llama3_rope_scaling_frequencies_match_transformers(tmp_path, gloo_group):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    source = tmp_path / "hf"
    hf = H.make_family(str(source), "llama3")
    _, loaded = megatron_logits(source, H.tokens(length=8))
    assert loaded.config.model.use_rope_scaling and loaded.config.model.rotary_base == 500000
    ours = loaded.model.rotary_pos_emb.inv_freq
    theirs = hf.model.rotary_emb.inv_freq
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)
    unscaled = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=500000,
                               use_cpu_initialization=True).inv_freq
    assert not torch.allclose(unscaled, theirs, rtol=1e-3, atol=0)  # the check can fail
