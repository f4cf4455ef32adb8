"""The language model of multimodal folders (Qwen3.5 ``qwen3_5`` and Qwen3.5-MoE
``qwen3_5_moe`` with their vision tower and MTP layer, Gemma 3 ``gemma3`` with its SigLIP
tower and projector), trained on text alone: tiny random folders give transformers' logits
on text, HF -> mcore -> HF gives every tensor back bit for bit, after training the export
writes the tensors the model did not train (the vision side) back unchanged while the
language model's carry the training, and an export whose source folder is gone or changed
is refused."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_helpers as H
from test_qwen3_5 import HYBRID, MOE

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU delta rule")

QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                   out_hidden_size=64, num_position_embeddings=16)
GEMMA_TEXT = dict(H.BASE, head_dim=16, sliding_window=8, layer_types=["sliding_attention",
                                                                     "full_attention"],
                  query_pre_attn_scalar=16)
GEMMA_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, image_size=28, patch_size=14)


def make_multimodal(path, model_type, text, vision, **top):
    """A random multimodal model saved as transformers writes it (its language model under
    model.language_model), every norm off its init, and a tokenizer."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.for_model(model_type, text_config=text, vision_config=vision, **top)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="eager")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "dt_bias" in name or "A_log" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    model.float().save_pretrained(str(path))
    H.write_tokenizer(str(path))


def add_mtp(path):
    """Qwen3.5's MTP layer (mtp.* at the top of the files, mtp_num_hidden_layers in
    text_config), its decoder layer the language model's layer 3 moved off its weights."""
    state = load_file(str(path / "model.safetensors"))
    generator = torch.Generator().manual_seed(5)
    prefix = "model.language_model.layers.3."
    extra = {"mtp.layers.0." + name[len(prefix):]: tensor + 0.05 * torch.randn(
        tensor.shape, generator=generator) for name, tensor in state.items()
        if name.startswith(prefix)}
    h = state["model.language_model.embed_tokens.weight"].shape[1]
    extra.update({"mtp.fc.weight": 0.05 * torch.randn(h, 2 * h, generator=generator),
                  **{f"mtp.{name}.weight": 0.3 * torch.randn(h, generator=generator)
                     for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}})
    save_file({**state, **extra}, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_vl") / "hf"
    make_multimodal(path, "qwen3_5", dict(H.BASE, **HYBRID), QWEN_VISION)
    add_mtp(path)
    return path


@pytest.fixture(scope="module")
def qwen_moe_vl(tmp_path_factory):
    """Qwen3.5-MoE's vision-language folder (qwen3_5_moe), its MTP layer an MoE layer too."""
    path = tmp_path_factory.mktemp("qwen3_5_moe_vl") / "hf"
    make_multimodal(path, "qwen3_5_moe", dict(H.BASE, **HYBRID, **MOE), QWEN_VISION)
    add_mtp(path)
    return path


@pytest.fixture(scope="module")
def gemma_vl(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3_vl") / "hf"
    make_multimodal(path, "gemma3", GEMMA_TEXT, GEMMA_VISION, mm_tokens_per_image=4)
    return path


@pytest.mark.parametrize("which", ["qwen_vl", "qwen_moe_vl", "gemma_vl"])
def test_text_logits_match_and_round_trip_is_bit_identical(which, request, tmp_path,
                                                           gloo_group):
    """The language model alone gives transformers' logits on text; HF -> mcore -> HF
    writes every tensor back (the vision side copied, the MTP layer converted)."""
    from swift_mcore.loaded_model import forward_logits, load_model

    source = request.getfixturevalue(which)
    loaded = load_model(str(source), log=lambda line: None)
    ids = H.tokens(length=40)
    ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    assert (ours - H.hf_logits(str(source), ids)).abs().max() <= 1e-4
    carried = [n for n in H.safetensors_state(str(source))
               if not n.startswith(("model.language_model.", "mtp.", "lm_head."))]
    assert carried  # the vision tower, which the round trip must give back too
    config = H.check_round_trip(source, tmp_path)
    original = json.loads((source / "config.json").read_text())
    assert config["model_type"] == original["model_type"]
    assert config["architectures"] == original["architectures"]
    assert config["vision_config"] == original["vision_config"]


@pytest.mark.slow
def test_training_on_text_exports_the_vision_side_unchanged(qwen_vl, tmp_path, train_here):
    """pt on the Qwen3.5 vision-language folder (text alone, its MTP layer too): the export
    holds every tensor of the source; the vision tower's are the source's bit for bit, the
    language model's and the MTP layer's moved, and transformers' model of the exported
    folder gives the checkpoint's logits."""
    from run_helpers import train_records
    from swift_mcore.loaded_model import forward_logits, load_model
    from test_hf_training import run_flags

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(100)))
    out = tmp_path / "pt"
    train_here(out, "--model", qwen_vl, "--dataset", data, "--seq_length", "32", "--lr",
               "1e-2", "--train_iters", "2", "--save_steps", "2", "--mtp_num_layers", "1",
               command="pt", base=run_flags())
    assert all(r["mtp_loss"] > 0 for r in train_records(out))
    back = tmp_path / "back"
    H.convert(out / "checkpoint", back, "to_hf")
    trained, initial = H.safetensors_state(str(back)), H.safetensors_state(str(qwen_vl))
    assert sorted(trained) == sorted(initial)
    vision = [name for name in initial if name.startswith("model.visual.")]
    assert vision and all(torch.equal(trained[n], initial[n]) for n in vision)
    for name in ("model.language_model.layers.0.linear_attn.in_proj_qkv.weight",
                 "model.language_model.embed_tokens.weight", "mtp.fc.weight"):
        assert not torch.equal(trained[name], initial[name]), name
    config = json.loads((back / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and config["text_config"]["mtp_num_hidden_layers"] == 1
    ids = H.tokens(length=40)
    loaded = load_model(str(out / "checkpoint"), log=lambda line: None)
    ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    assert (ours - H.hf_logits(str(back), ids)).abs().max() <= 1e-4


@pytest.mark.parametrize("change, message", [
    # Gemma 3's configs hold null (transformers' default); a number is refused, not ignored
    (dict(final_logit_softcapping=30.0), "text_config: final_logit_softcapping 30.0 (logit "
                                         "soft-capping is not supported; only null)"),
    (dict(attn_logit_softcapping=50.0), "text_config: attn_logit_softcapping 50.0"),
    (dict(num_hidden_layers="2"), "text_config: num_hidden_layers '2' is a string"),
])
def test_what_the_language_model_cannot_express_is_named(gemma_vl, tmp_path, change, message):
    import re
    import shutil

    from swift_mcore.arguments import RunArguments
    from swift_mcore.errors import ArgumentError
    from swift_mcore.run_config import resolve

    folder = tmp_path / "hf"
    shutil.copytree(gemma_vl, folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"].update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArgumentError, match=re.escape(message)):
        resolve(RunArguments.from_flags(model=str(folder), seq_length=32), world_size=1)


def test_a_tied_head_that_differs_is_refused_under_either_name(gemma_vl, tmp_path,
                                                               gloo_group):
    """tie_word_embeddings true, and the files hold a head that is not the embedding: under
    language_model.lm_head.weight or lm_head.weight (beside language_model.model.*, which
    transformers reads as the head too; it was left out, and the embedding used)."""
    import shutil

    from swift_mcore.errors import ArgumentError
    from swift_mcore.loaded_model import load_model

    for head in ("language_model.lm_head.weight", "lm_head.weight"):
        folder = tmp_path / head
        shutil.copytree(gemma_vl, folder)
        state = load_file(str(folder / "model.safetensors"))
        embedding = next(t for name, t in state.items() if name.endswith("embed_tokens.weight"))
        state[head] = embedding + 0.5
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ArgumentError, match="lm_head.weight differs from model.embed_tokens"
                                                ".weight, but .* says tie_word_embeddings true"):
            load_model(str(folder), log=lambda line: None)


# ---- the export of a checkpoint whose source folder is gone or changed -------------------
@pytest.fixture(scope="module")
def qwen_vl_checkpoint(qwen_vl, tmp_path_factory, gloo_group):
    """A copy of the Qwen3.5 vision-language folder (the tests below change it, then put it
    back) and its checkpoint (export --to_mcore)."""
    import shutil

    root = tmp_path_factory.mktemp("qwen3_5_vl_source")
    source, pristine = root / "hf", root / "pristine"
    shutil.copytree(qwen_vl, source)
    shutil.copytree(qwen_vl, pristine)
    H.convert(source, root / "mcore", "to_mcore")
    return source, pristine, root / "mcore"


@pytest.fixture
def source_folder(qwen_vl_checkpoint):
    """The checkpoint's source folder, restored after the test changed it."""
    import shutil

    source, pristine, checkpoint = qwen_vl_checkpoint
    yield source, checkpoint
    shutil.rmtree(source, ignore_errors=True)
    shutil.copytree(pristine, source)


def _set_tensor(folder, name, change):
    state = load_file(str(folder / "model.safetensors"))
    state[name] = change(state[name])
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _drop_vision(folder):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config["text_config"]))


@pytest.mark.parametrize("change, reason", [
    (lambda f: __import__("shutil").rmtree(f), "{f} no longer exists"),
    (lambda f: (f / "config.json").unlink(),
     "{f} is no longer a Hugging Face folder (no config.json)"),
    (_drop_vision, "{f} is no longer a multimodal qwen3_5 folder"),
    (lambda f: _set_tensor(f, "model.visual.blocks.0.attn.qkv.weight", lambda t: t + 1),
     "changed: model.visual.blocks.0.attn.qkv.weight (its values)"),
    (lambda f: _set_tensor(f, "model.visual.blocks.0.attn.qkv.weight", lambda t: t[:8]),
     "changed: model.visual.blocks.0.attn.qkv.weight (F32 [96, 32] then, F32 [8, 32] now)"),
], ids=["gone", "not_a_folder", "not_multimodal", "values", "shape"])
def test_export_refuses_when_the_vision_source_is_gone_or_changed(source_folder, tmp_path,
                                                                  capsys, change, reason):
    """export --to_hf of the language model of a multimodal folder: when that folder is
    gone, no longer multimodal, or its vision tower differs from training's, one line
    naming the folder and what differs, exit code 2, nothing written."""
    from swift_mcore.export import main

    source, checkpoint = source_folder
    change(source)
    out = tmp_path / "out"
    assert main(["--to_hf", "--model", str(checkpoint), "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("swift-mcore export: error: ")
    assert f"the language model of the multimodal folder {source}," in err
    assert reason.format(f=source) in err
    assert "add --text_only to write the language model alone" in err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []


def test_text_only_writes_the_language_model_alone(source_folder, qwen_vl, tmp_path):
    """--text_only: the checkpoint whose folder is gone exports as the text model (no
    vision tensors, the qwen3_5_text config), which gives the checkpoint's logits."""
    import shutil

    from swift_mcore.loaded_model import forward_logits, load_model

    source, checkpoint = source_folder
    shutil.rmtree(source)
    out = tmp_path / "text"
    H.convert(checkpoint, out, "to_hf", text_only=True, tokenizer=str(qwen_vl))
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and "vision_config" not in config
    names = H.safetensors_state(str(out))
    assert names and not any("visual" in n for n in names)
    ids = H.tokens(length=40)
    loaded = load_model(str(checkpoint), tokenizer=str(qwen_vl), log=lambda line: None)
    ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    assert (ours - H.hf_logits(str(out), ids)).abs().max() <= 1e-4


def test_the_checkpoint_records_its_vision_source(qwen_vl_checkpoint):
    """run.json names the folder and fingerprints each tensor the model did not train."""
    source, _, checkpoint = qwen_vl_checkpoint
    run = json.loads((checkpoint / "checkpoint" / "iter_0000000" / "run.json").read_text())
    record = run["multimodal_source"]
    assert record["folder"] == str(source) and record["model_type"] == "qwen3_5"
    vision = [n for n in H.safetensors_state(str(source)) if n.startswith("model.visual.")]
    assert sorted(record["carried"]) == sorted(vision)
    assert all(v.split()[-1].startswith("sha256:") for v in record["carried"].values())


def test_text_only_is_refused_for_a_text_model(tmp_path, capsys, gloo_group):
    """--text_only on a checkpoint of a text folder would change nothing: refused by name."""
    from swift_mcore.export import main

    H.make_model(str(tmp_path / "hf"), "qwen3")
    H.convert(tmp_path / "hf", tmp_path / "mcore", "to_mcore")
    capsys.readouterr()
    out = tmp_path / "out"
    assert main(["--to_hf", "--text_only", "--model", str(tmp_path / "mcore"),
                 "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"swift-mcore export: error: --text_only: --model {tmp_path / 'mcore'} is "
                   f"not the language model of a multimodal folder (it exports as a text "
                   f"model anyway); drop --text_only")
    assert not out.exists()


@pytest.mark.slow
def test_a_run_from_the_checkpoint_keeps_its_record_of_the_vision_source(
        source_folder, tmp_path, capsys, train_here):
    """pt --load CHECKPOINT --finetune after the vision tower changed: the new checkpoint
    records the tower as the first checkpoint did, so its export is refused too."""
    from swift_mcore.export import main
    from swift_mcore.models import carried
    from test_hf_training import run_flags

    source, checkpoint = source_folder
    _set_tensor(source, "model.visual.blocks.0.attn.qkv.weight", lambda t: t + 1)
    carried._RECORDS.clear()  # as a new process: it has not fingerprinted the folder yet
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def f(x):\n    return x  # {i}\n"}) + "\n"
                            for i in range(40)))
    out = tmp_path / "ft"
    train_here(out, "--model", source, "--load", checkpoint, "--finetune", "--dataset", data,
               "--seq_length", "32", "--train_iters", "1", "--save_steps", "1",
               "--mtp_num_layers", "1", command="pt", base=run_flags())
    capsys.readouterr()
    assert main(["--to_hf", "--model", str(out), "--output_dir", str(tmp_path / "o")]) == 2
    assert "changed: model.visual.blocks.0.attn.qkv.weight (its values)" in \
        capsys.readouterr().err

