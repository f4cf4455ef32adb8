"""The multi-token prediction layer of Qwen3-Next and Qwen3.5 folders (``mtp.*`` tensors and
config.json's mtp_num_hidden_layers, which transformers ignores): --mtp_num_layers 1 loads
it into megatron's MTP block, whose loss equals one built by hand from transformers' own
modules with the same weights; HF -> mcore -> HF gives every tensor back bit for bit; a
folder with the layer needs the flag (1, or 0 to leave it out); pt trains it, logs its
loss, exports it and resumes exactly. Qwen3.5's (dense) is converted in a vision-language
folder in test_multimodal_text.py."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_helpers as H
from swift_mcore.errors import ArgumentError
from test_qwen3_next import make_next

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU delta rule")


def add_mtp_layer(folder):
    """Writes the hub's MTP tensors into ``folder``: mtp.layers.0.* a full-attention decoder
    layer (layer 3's weights, each moved off them), mtp.fc and the three zero-centred norms
    off their init; config.json says mtp_num_hidden_layers 1."""
    state = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(5)

    def moved(tensor):
        return tensor + 0.05 * torch.randn(tensor.shape, generator=generator)

    extra = {"mtp.layers.0." + name[len("model.layers.3."):]: moved(tensor)
             for name, tensor in state.items() if name.startswith("model.layers.3.")}
    h = state["model.embed_tokens.weight"].shape[1]
    extra.update({"mtp.fc.weight": 0.05 * torch.randn(h, 2 * h, generator=generator),
                  **{f"mtp.{name}.weight": 0.3 * torch.randn(h, generator=generator)
                     for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}})
    save_file({**state, **extra}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    H.edit_config(str(folder), mtp_num_hidden_layers=1)


@pytest.fixture(scope="module")
def next_mtp(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next_mtp") / "hf"
    make_next(path)
    add_mtp_layer(path)
    return path


def reference_mtp_loss(source, tokens, tmp_path):
    """Qwen3-Next's MTP by hand from transformers' modules: the main model's final hidden
    states (after its norm), pre_fc_norm_hidden of those, pre_fc_norm_embedding of the next
    token's embedding, [e; h] -> fc -> a full-attention decoder layer holding mtp.layers.0
    (causal, the same positions) -> mtp.norm -> lm_head; cross entropy against the token two
    places ahead."""
    import shutil

    from transformers import AutoModelForCausalLM

    def load(folder):
        return AutoModelForCausalLM.from_pretrained(
            str(folder), attn_implementation="eager").eval().float()

    model = load(source)
    weights = load_file(str(source / "model.safetensors"))
    mtp = {name[len("mtp."):]: t for name, t in weights.items() if name.startswith("mtp.")}
    # the MTP decoder layer: transformers' layer 3 (full attention, MoE) holding mtp.layers.0
    swapped = tmp_path / "swapped"
    shutil.copytree(source, swapped)
    save_file({**{name: t for name, t in weights.items() if not name.startswith("mtp.")},
               **{"model.layers.3." + name[len("layers.0."):]: t
                  for name, t in mtp.items() if name.startswith("layers.0.")}},
              str(swapped / "model.safetensors"), metadata={"format": "pt"})
    layer = load(swapped).model.layers[3]
    h = model.config.hidden_size

    def norm(weight):
        module = type(model.model.norm)(h, eps=model.config.rms_norm_eps)
        module.weight.data.copy_(weight)
        return module

    inputs = tokens[:, :-1]
    length = inputs.shape[1]
    with torch.no_grad():
        hidden = model.model(inputs).last_hidden_state
        following = torch.roll(inputs, -1, dims=1)
        following[:, -1] = 0  # megatron's roll fills the last place (its loss is masked)
        embedded = model.model.embed_tokens(following)
        x = torch.cat([norm(mtp["pre_fc_norm_embedding.weight"])(embedded),
                       norm(mtp["pre_fc_norm_hidden.weight"])(hidden)], dim=-1) \
            @ mtp["fc.weight"].T
        positions = torch.arange(length)[None]
        mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
        out = layer(x, position_embeddings=model.model.rotary_emb(x, positions),
                    attention_mask=mask, position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        logits = model.lm_head(norm(mtp["norm.weight"])(out))
        return torch.nn.functional.cross_entropy(
            logits[:, : length - 1].reshape(-1, logits.shape[-1]), tokens[:, 2:].reshape(-1))


def test_mtp_loss_agrees_with_a_reference_from_transformers_modules(next_mtp, tmp_path,
                                                                    gloo_group):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from swift_mcore.loaded_model import forward_logits, load_model

    loaded = load_model(str(next_mtp), log=lambda line: None)
    assert loaded.config.model.mtp_num_layers == 1
    tokens = H.tokens(length=33)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    model = loaded.model.train()  # megatron tracks the MTP loss in training mode
    MTPLossLoggingHelper.tracker.clear()
    with torch.no_grad():
        model(input_ids=inputs, position_ids=torch.arange(32)[None].expand(2, -1),
              attention_mask=None, labels=labels)
    ours = float(MTPLossLoggingHelper.tracker["values"][0])
    MTPLossLoggingHelper.tracker.clear()
    theirs = float(reference_mtp_loss(next_mtp, tokens, tmp_path))
    assert abs(ours - theirs) < 1e-5, (ours, theirs)
    # the logits (no labels) skip the MTP layer: transformers' own
    ids = H.tokens(length=40)
    assert (forward_logits(loaded.model.eval(), ids)[..., : loaded.vocab]
            - H.hf_logits(str(next_mtp), ids)).abs().max() <= 1e-4


def test_round_trip_keeps_the_mtp_layer_bit_for_bit(next_mtp, tmp_path, gloo_group):
    config = H.check_round_trip(next_mtp, tmp_path)  # every tensor, mtp.* included
    assert config["mtp_num_hidden_layers"] == 1
    assert "mtp.fc.weight" in H.safetensors_state(str(tmp_path / "back"))


def test_the_flag_decides_what_happens_to_the_mtp_layer(next_mtp, tmp_path, gloo_group):
    """Unset: refused, naming the flag; 0: the model loads without it; 2: refused;
    mtp.* tensors that config.json does not announce: refused by name, not dropped;
    mtp_num_hidden_layers 2 (one fc shared by two layers): refused by name."""
    import re
    import shutil

    from swift_mcore.arguments import RunArguments
    from swift_mcore.models.gpt import build_model
    from swift_mcore.models.hf_load import load_hf_weights
    from swift_mcore.run_config import resolve

    def config(source, **flags):
        flags = RunArguments.from_flags(model=str(source), seq_length=32, **flags)
        return resolve(flags, world_size=1).complete(300, None)

    with pytest.raises(ArgumentError, match=(
            rf"^--model {next_mtp} holds 1 multi-token prediction layer\(s\) "
            rf"\(mtp_num_hidden_layers 1\): give --mtp_num_layers 1 to load, train and "
            rf"export them, or --mtp_num_layers 0 to leave them out$")):
        config(next_mtp)
    with pytest.raises(ArgumentError, match=r"^--mtp_num_layers 2: --model .* holds 1 multi"):
        config(next_mtp, mtp_num_layers=2)
    without = config(next_mtp, mtp_num_layers=0)
    model = build_model(without)
    assert load_hf_weights(without, model, log=lambda line: None) > 0
    assert not hasattr(model[0], "mtp") or model[0].mtp_process is False

    unannounced = tmp_path / "unannounced"
    shutil.copytree(next_mtp, unannounced)
    H.edit_config(str(unannounced), mtp_num_hidden_layers=0)
    plain = config(unannounced)
    with pytest.raises(ArgumentError, match=re.escape(
            "mtp.fc.weight is not part of this model")):
        load_hf_weights(plain, build_model(plain), log=lambda line: None)

    H.edit_config(str(unannounced), mtp_num_hidden_layers=2)
    with pytest.raises(ArgumentError, match=re.escape(
            "mtp_num_hidden_layers 2 (its MTP layers share one fc")):
        config(unannounced)


@pytest.mark.slow
def test_pt_trains_the_mtp_layer_exports_it_and_resumes_exactly(next_mtp, tmp_path,
                                                                 train_here):
    """pt --mtp_num_layers 1 for 4 steps saving at 2: both losses logged, the MTP layer's
    weights move and are exported under their own names (the rest gives transformers'
    logits); resumed from step 2 it logs steps 3 and 4 exactly, both losses."""
    from run_helpers import train_records
    from swift_mcore.loaded_model import forward_logits, load_model
    from test_hf_training import run_flags

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(100)))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    flags = ["--model", next_mtp, "--dataset", data, "--seq_length", "32", "--lr", "1e-2",
             "--train_iters", "4", "--mtp_num_layers", "1"]
    train_here(straight, *flags, "--save_steps", "2", command="pt", base=run_flags())
    train_here(resumed, *flags, "--no_save", "--resume",
               straight / "checkpoint" / "iter_0000002", command="pt", base=run_flags())
    ref = {r["iteration"]: r for r in train_records(straight)}
    got = {r["iteration"]: r for r in train_records(resumed)}
    assert sorted(ref) == [1, 2, 3, 4] and all(r["mtp_loss"] > 0 for r in ref.values())
    assert sorted(got) == [3, 4]
    for i in got:
        assert (got[i]["loss"], got[i]["mtp_loss"]) == (ref[i]["loss"], ref[i]["mtp_loss"]), i

    back = tmp_path / "back"
    H.convert(straight / "checkpoint", back, "to_hf")
    trained, initial = H.safetensors_state(str(back)), H.safetensors_state(str(next_mtp))
    assert sorted(trained) == sorted(initial)
    for name in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight",
                 "mtp.layers.0.self_attn.q_proj.weight"):
        assert not torch.equal(trained[name], initial[name]), name
    assert json.loads((back / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    ids = H.tokens(length=40)
    loaded = load_model(str(straight / "checkpoint"), log=lambda line: None)
    ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    assert (ours - H.hf_logits(str(back), ids)).abs().max() <= 1e-4
