"""Multi-token prediction layers of Hugging Face folders (DeepSeek-V3, GLM-4.5: the layers
past num_hidden_layers that transformers ignores): the MTP loss megatron computes from a
folder's MTP layer equals one built by hand from transformers' own modules with the same
weights; HF -> mcore -> HF gives them back bit for bit; a folder with MTP layers needs
--mtp_num_layers (its count, or 0 to leave them out), and copies of the embedding or output
layer that differ from the model's are refused."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_helpers as H
from swift_mcore.errors import ArgumentError
from test_deepseek_v3 import make_deepseek
from test_glm4_moe import make_glm

MAKERS = {"deepseek_v3": make_deepseek, "glm4_moe": make_glm}


def add_mtp_layer(folder, family, tmp_path):
    """Writes one MTP layer into ``folder`` (3 decoder layers) as the hub's folders hold it:
    model.layers.3.* = a decoder layer (taken from a 4-layer model of the family), enorm,
    hnorm, eh_proj, shared_head.norm off their init, and copies of the embedding and
    lm_head; config.json says num_nextn_predict_layers 1. Returns the 4-layer model, whose
    layer 3 is the MTP layer's decoder layer."""
    bigger = tmp_path / f"{family}-4"
    big = MAKERS[family](bigger, num_hidden_layers=4)
    state = load_file(str(folder / "model.safetensors"))
    layer = {name: tensor for name, tensor in load_file(str(bigger / "model.safetensors"))
             .items() if name.startswith("model.layers.3.")}
    generator = torch.Generator().manual_seed(5)
    h = state["model.embed_tokens.weight"].shape[1]
    extra = {"enorm.weight": 1 + 0.3 * torch.randn(h, generator=generator),
             "hnorm.weight": 1 + 0.3 * torch.randn(h, generator=generator),
             "eh_proj.weight": 0.05 * torch.randn(h, 2 * h, generator=generator),
             "shared_head.norm.weight": 1 + 0.3 * torch.randn(h, generator=generator),
             "embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
             "shared_head.head.weight": state["lm_head.weight"].clone()}
    state.update(layer)
    state.update({f"model.layers.3.{name}": tensor for name, tensor in extra.items()})
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    H.edit_config(str(folder), num_nextn_predict_layers=1)
    return big


@pytest.fixture(scope="module", params=sorted(MAKERS))
def folder(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    source = tmp / "hf"
    MAKERS[request.param](source)
    big = add_mtp_layer(source, request.param, tmp)
    return request.param, source, big


def reference_mtp_loss(source, big, tokens):
    """DeepSeek-V3's MTP by hand from transformers' modules: the main model's final hidden
    states (after its norm), hnorm of those, enorm of the next token's embedding, [e; h] ->
    eh_proj -> the MTP decoder layer (causal, the same positions) -> shared_head.norm -> the
    head; cross entropy against the token two places ahead."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(source), attn_implementation="eager")
    model = model.eval().float()
    weights = load_file(str(source / "model.safetensors"))
    mtp = {name[len("model.layers.3."):]: t for name, t in weights.items()
           if name.startswith("model.layers.3.")}
    norm_class = type(model.model.norm)
    h = model.config.hidden_size

    def norm(weight):
        module = norm_class(h, eps=model.config.rms_norm_eps)
        module.weight.data.copy_(weight)
        return module

    inputs = tokens[:, :-1]
    batch, length = inputs.shape
    with torch.no_grad():
        hidden = model.model(inputs).last_hidden_state
        following = torch.roll(inputs, -1, dims=1)
        following[:, -1] = 0  # megatron's roll fills the last place (its loss is masked)
        embedded = torch.nn.functional.embedding(following, mtp["embed_tokens.weight"])
        x = torch.cat([norm(mtp["enorm.weight"])(embedded),
                       norm(mtp["hnorm.weight"])(hidden)], dim=-1) @ mtp["eh_proj.weight"].T
        positions = torch.arange(length)[None]
        mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
        layer = big.model.layers[3].eval()
        out = layer(x, attention_mask=mask, position_ids=positions,
                    position_embeddings=big.model.rotary_emb(x, positions))
        out = out[0] if isinstance(out, tuple) else out
        logits = norm(mtp["shared_head.norm.weight"])(out) @ mtp["shared_head.head.weight"].T
        return torch.nn.functional.cross_entropy(
            logits[:, : length - 1].reshape(-1, logits.shape[-1]), tokens[:, 2:].reshape(-1))


def test_mtp_loss_agrees_with_a_reference_from_transformers_modules(folder, gloo_group):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from swift_mcore.loaded_model import load_model

    family, source, big = folder
    loaded = load_model(str(source), log=lambda line: None)
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
    theirs = float(reference_mtp_loss(source, big, tokens))
    assert abs(ours - theirs) < 1e-5, (family, ours, theirs)


def test_round_trip_keeps_the_mtp_layers_bit_for_bit(folder, tmp_path, gloo_group):
    family, source, _ = folder
    config = H.check_round_trip(source, tmp_path)  # every tensor, the MTP layer's included
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 3
    assert "model.layers.3.eh_proj.weight" in H.safetensors_state(str(tmp_path / "back"))
    # --test_convert_precision says in one line that transformers leaves the MTP layer out
    # (transformers' own load report, which lists each of its tensors as UNEXPECTED, is
    # silenced)
    from swift_mcore.arguments.export import ExportArguments
    from swift_mcore.export import run

    lines = []
    run(ExportArguments(model=str(tmp_path / "mcore"), output_dir=str(tmp_path / "again"),
                        to_hf=True, test_convert_precision=True).validate(), log=lines.append)
    assert f"test_convert_precision: transformers builds no multi-token prediction layers; " \
           f"the 1 of {tmp_path / 'again'} are left out of the comparison" in lines


def test_the_flag_decides_what_happens_to_a_folders_mtp_layers(folder, tmp_path, gloo_group):
    """Unset: refused, naming the flag; 0: the model loads without them; another count:
    refused; copies that differ from the model's embedding or head: refused."""
    import shutil

    from swift_mcore.arguments import RunArguments
    from swift_mcore.models.gpt import build_model
    from swift_mcore.models.hf_load import load_hf_weights
    from swift_mcore.run_config import resolve

    family, source, _ = folder

    def config(**flags):
        flags = RunArguments.from_flags(model=str(source), seq_length=32, **flags)
        return resolve(flags, world_size=1).complete(300, None)

    with pytest.raises(ArgumentError, match=(
            rf"^--model {source} holds 1 multi-token prediction layer\(s\) "
            rf"\(num_nextn_predict_layers 1\): give --mtp_num_layers 1 to load, train and "
            rf"export them, or --mtp_num_layers 0 to leave them out$")):
        config()
    with pytest.raises(ArgumentError, match=r"^--mtp_num_layers 2: --model .* holds 1 multi"):
        config(mtp_num_layers=2)
    without = config(mtp_num_layers=0)
    model = build_model(without)
    assert load_hf_weights(without, model, log=lambda line: None) > 0
    assert not hasattr(model[0], "mtp") or model[0].mtp_process is False

    changed = tmp_path / "changed"
    shutil.copytree(source, changed)
    state = load_file(str(changed / "model.safetensors"))
    state["model.layers.3.shared_head.head.weight"][7, 3] += 1
    save_file(state, str(changed / "model.safetensors"), metadata={"format": "pt"})
    source = changed
    with_mtp = config(mtp_num_layers=1)
    with pytest.raises(ArgumentError, match=(
            r"model.layers.3.shared_head.head.weight differs from lm_head.weight; megatron's "
            r"MTP layers share")):
        load_hf_weights(with_mtp, build_model(with_mtp), log=lambda line: None)


def deepseek_chat(folder, tmp_path):
    """(the DeepSeek-V3 folder, 32 chat rows) for the runs one family is enough for (the
    GLM-4.5 case skips: both share the MTP mapping)."""
    from test_moe_training import write_chat

    family, source, _ = folder
    if family != "deepseek_v3":
        pytest.skip("one family is enough for the run (both share the mapping)")
    data = tmp_path / "chat.jsonl"
    write_chat(data, 32)
    return source, data


def resumed_in_a_process(flags, out, again):
    """sft ``flags`` resumed from ``out``'s iteration-2 checkpoint into ``again`` in a
    process of its own (saving at 3): its train records by iteration."""
    from run_helpers import ROOT, child_env, train_records

    proc = subprocess.run(
        [sys.executable, "-m", "swift_mcore", "sft", *flags, "--save_steps", "3",
         "--output_dir", str(again), "--resume", str(out / "checkpoint" / "iter_0000002")],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=child_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["iteration"]: r for r in train_records(again)}


def mtp_sft_flags(source, data, lr: str):
    """sft of ``source`` with its MTP layer, three iterations at a constant ``lr``."""
    from test_hf_training import run_flags

    return [*run_flags(), "--model", str(source), "--dataset", str(data), "--template",
            "plain", "--seq_length", "48", "--train_iters", "3", "--lr", lr, "--min_lr", lr,
            "--mtp_num_layers", "1"]


@pytest.mark.slow
def test_sft_trains_the_mtp_layer_exports_it_and_resumes_exactly(folder, tmp_path, gloo_group):
    """`sft --model FOLDER --mtp_num_layers 1`: both losses are logged, the MTP layer's
    weights move and are exported (the rest gives transformers' logits), and a run resumed
    from iteration 2 repeats both losses and ends with the same MTP weights, bit for bit."""
    from swift_mcore.arguments import SftArguments, parse_args
    from swift_mcore.loaded_model import forward_logits, load_model
    from swift_mcore.run_config import resolve
    from test_deepseek_v3 import _train
    from run_helpers import train_records

    source, data = deepseek_chat(folder, tmp_path)
    out, again = tmp_path / "sft", tmp_path / "again"
    flags = [*mtp_sft_flags(source, data, "1e-2"), "--mtp_loss_scaling_factor", "0.3"]
    config = resolve(parse_args([*flags, "--save_steps", "2", "--output_dir", str(out)],
                                cls=SftArguments), world_size=1)
    assert _train(config).iteration == 3
    ref = {r["iteration"]: r for r in train_records(out)}
    assert all(r["mtp_loss"] > 0 for r in ref.values())
    assert ref[3]["mtp_loss"] < ref[1]["mtp_loss"], ref

    back = tmp_path / "back"
    H.convert(out / "checkpoint", back, "to_hf")
    trained, initial = H.safetensors_state(str(back)), H.safetensors_state(str(source))
    assert sorted(trained) == sorted(initial)  # the MTP layer is written back
    assert not torch.equal(trained["model.layers.3.eh_proj.weight"],
                           initial["model.layers.3.eh_proj.weight"])
    assert json.loads((back / "config.json").read_text())["num_nextn_predict_layers"] == 1
    ids = H.tokens()
    loaded = load_model(str(out / "checkpoint"), log=lambda line: None)
    ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    assert (ours - H.hf_logits(str(back), ids)).abs().max() <= 1e-4

    # resumed in a process of its own: nothing of the first run's process state helps it
    got = resumed_in_a_process(flags, out, again)
    assert sorted(got) == [3]
    for i in got:
        assert (got[i]["loss"], got[i]["mtp_loss"]) == (ref[i]["loss"], ref[i]["mtp_loss"]), i
    H.convert(again / "checkpoint", tmp_path / "back2", "to_hf")
    repeated = H.safetensors_state(str(tmp_path / "back2"))
    for name in ("model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight",
                 "model.layers.3.mlp.gate.e_score_correction_bias",
                 "model.layers.3.self_attn.kv_b_proj.weight"):
        assert torch.equal(repeated[name], trained[name]), name


def test_infer_on_a_folder_with_mtp_layers_gives_transformers_greedy_tokens(folder, capsys,
                                                                            gloo_group):
    """The folder's MTP layer is loaded but generation (logits without labels) skips it."""
    H.check_infer_is_greedy(folder[1], capsys)


def test_new_mtp_layers_on_a_folder_without_them_train_and_export_is_refused(tmp_path,
                                                                           gloo_group):
    """A Llama folder with --mtp_num_layers 1: the model loads, its MTP layer keeps its
    initialization (the log says so); a llama folder cannot hold it, so writing one is
    refused naming the flag."""
    from swift_mcore.arguments import RunArguments
    from swift_mcore.models import families
    from swift_mcore.models.gpt import build_model
    from swift_mcore.models.hf_load import load_hf_weights
    from swift_mcore.run_config import resolve

    source = tmp_path / "llama"
    H.make_family(str(source), "llama")
    config = resolve(RunArguments.from_flags(model=str(source), seq_length=32,
                                             mtp_num_layers=1), world_size=1).complete(300, None)
    model = build_model(config)
    initial = model[0].mtp.layers[0].eh_proj.weight.clone()
    lines = []
    load_hf_weights(config, model, log=lines.append)
    assert torch.equal(model[0].mtp.layers[0].eh_proj.weight, initial)
    assert initial.abs().sum() > 0  # initialized, not left empty
    assert any("holds no MTP layers; they start from their initialization" in line
               for line in lines), lines
    with pytest.raises(ArgumentError, match=r"--mtp_num_layers 1 \(a llama folder holds no "
                                            r"multi-token prediction layers\)"):
        families.for_model_args(config.model)


def test_a_lora_run_with_new_mtp_layers_records_their_initialization(tmp_path):
    """LoRA on a folder without MTP layers, with --mtp_num_layers: the new layers' frozen base
    weights are drawn from the seed on the last pipeline stage (its seed, after its decoder
    layers), which a LoRA checkpoint does not hold. The base reference names that draw, so a
    resume at another pipeline layout (other frozen MTP weights: another MTP loss) is refused
    by base_model instead of training on; the folder's own layers alone do not depend on it."""
    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve

    source = tmp_path / "llama"
    H.make_family(str(source), "llama")

    def reference(mtp, pp, **flags):
        return resolve(RunArguments.from_flags(
            model=str(source), seq_length=32, mtp_num_layers=mtp, tuner_type="lora",
            pipeline_model_parallel_size=pp, micro_batch_size=1, global_batch_size=2 * pp,
            **flags),
            world_size=pp).base_model

    one = reference(1, 1)
    assert one.startswith("sha256:") and "MTP" in one and "--seed 42" in one
    assert reference(1, 2) != one and "PP 2, 1 decoder layer(s) before" in reference(1, 2)
    assert reference(1, 1, seed=7) != one
    assert reference(0, 1) == reference(0, 2)  # the folder's weights alone


@pytest.mark.benchmark  # outside the suite's time budget: run with -m benchmark
def test_ep2_with_the_mtp_layer_gives_the_ep1_losses(folder, tmp_path, train_here):
    """Continued pretraining of a DeepSeek-V3 folder with its MTP layer at EP=2 (each rank
    loads its experts of the MTP layer's MoE too) gives the one-rank LM and MTP losses."""
    from run_helpers import train_records
    from test_hf_training import continue_pretraining, run_flags

    family, source, _ = folder
    if family != "deepseek_v3":
        pytest.skip("one family is enough for the run (both share the mapping)")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(200)))
    one, two = tmp_path / "ep1", tmp_path / "ep2"
    flags = ("--no_save", "--train_iters", "3", "--mtp_num_layers", "1",
             "--moe_router_bias_update_rate", "0.05")
    train_here(one, "--model", source, "--dataset", data, *flags, command="pt",
               base=run_flags())
    continue_pretraining(source, data, two, *flags, "--expert_model_parallel_size", "2",
                         nproc=2)
    ref, got = train_records(one), train_records(two)
    assert [r["iteration"] for r in got] == [1, 2, 3]
    for a, b in zip(ref, got):
        for key in ("loss", "mtp_loss"):
            assert abs(a[key] - b[key]) < 1e-5, (key, a, b)



# the two-rank layout each family's run is checked at (DeepSeek-V3's MLA takes no TP)
LAYOUTS = {"deepseek_v3": ("--pipeline_model_parallel_size", "2",
                           "--decoder_first_pipeline_num_layers", "1"),
           "glm4_moe": ("--tensor_model_parallel_size", "2", "--sequence_parallel")}


@pytest.mark.benchmark
def test_two_ranks_with_the_mtp_layer_give_the_one_rank_run(folder, tmp_path, train_here):
    """PP=2 (DeepSeek-V3): megatron builds the MTP layer on the last stage with its own copy
    of the embedding, its gradients joined with the first stage's. TP=2 with sequence
    parallelism (GLM-4.5): eh_proj's output rows split over the ranks, the MTP norms' weight
    gradients summed over them. Either gives the one-rank LM and MTP losses, and both
    checkpoints export the same folder, MTP layer included."""
    from run_helpers import train_records
    from test_hf_training import continue_pretraining, run_flags

    family, source, _ = folder
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(200)))
    one, two = tmp_path / "one", tmp_path / "two"
    flags = ("--train_iters", "3", "--save_steps", "3", "--mtp_num_layers", "1")
    train_here(one, "--model", source, "--dataset", data, *flags, command="pt",
               base=run_flags())
    continue_pretraining(source, data, two, *flags, *LAYOUTS[family], nproc=2)
    ref, got = train_records(one), train_records(two)
    assert [r["iteration"] for r in got] == [1, 2, 3]
    for a, b in zip(ref, got):
        for key in ("loss", "mtp_loss"):
            assert abs(a[key] - b[key]) < 1e-5, (key, a, b)
    for run in (one, two):
        H.convert(run / "checkpoint", run / "hf", "to_hf")
    first, second = H.safetensors_state(str(one / "hf")), H.safetensors_state(str(two / "hf"))
    assert sorted(first) == sorted(second) and "model.layers.3.eh_proj.weight" in second
    for name, tensor in first.items():  # Adam's steps amplify the layouts' rounding a bit
        assert torch.allclose(second[name], tensor, atol=1e-4), name


# LoRA on MLA's projections (peft loads those into transformers' DeepSeek-V3; the dense
# MLP's would clash with the experts', test_deepseek_v3) and on the MTP layer's eh_proj
MTP_LORA = ["--tuner_type", "lora", "--lora_rank", "4", "--lora_alpha", "16", "--lora_dropout",
            "0", "--target_modules", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
            "o_proj", "eh_proj"]
MTP_ADAPTED = ["mtp.layers.0.eh_proj"] + [
    f"mtp.layers.0.transformer_layer.self_attention.{kind}" for kind in (
        "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
        "linear_proj")]


@pytest.mark.slow
def test_lora_trains_the_mtp_layer_merges_it_and_resumes_exactly(folder, tmp_path,
                                                                 gloo_group):
    """--tuner_type lora with the folder's MTP layer: its transformer layer gets adapters as
    the decoder's do and its eh_proj when named, the MTP loss trains them (nothing else
    reaches them), its norms stay frozen; the merged export writes the MTP layer back with
    the adapters merged (swift-mcore's MTP loss of it is the checkpoint's); the routers'
    expert bias (the MTP layer's too) moves and is kept, so --to_peft refuses by name; a
    resumed run repeats both losses and the adapters and bias bit for bit, in a process of
    its own."""
    from swift_mcore.arguments import SftArguments, parse_args
    from swift_mcore.loaded_model import load_model
    from swift_mcore.run_config import resolve
    from test_deepseek_v3 import _train
    from run_helpers import train_records

    source, data = deepseek_chat(folder, tmp_path)
    out, again = tmp_path / "sft", tmp_path / "again"
    flags = [*mtp_sft_flags(source, data, "2e-2"), "--moe_router_bias_update_rate", "0.01",
             *MTP_LORA]
    config = resolve(parse_args([*flags, "--save_steps", "2", "--output_dir", str(out)],
                                cls=SftArguments), world_size=1)
    assert _train(config).iteration == 3
    ref = {r["iteration"]: r for r in train_records(out)}
    assert all(r["mtp_loss"] > 0 for r in ref.values())

    checkpoint = out / "checkpoint" / "iter_0000003"
    loaded = load_model(str(checkpoint), log=lambda line: None)
    state = loaded.model.state_dict()
    adapted = {n.split(".lora_", 1)[0] for n in state if n.startswith("mtp.") and ".lora_" in n}
    assert adapted == set(MTP_ADAPTED)
    for name in adapted:  # B starts at zero: only the MTP loss's gradients moved these
        assert state[f"{name}.lora_B.default.weight"].abs().max() > 0, name

    merged = tmp_path / "merged"
    H.convert(checkpoint, merged, "to_hf", merge_lora=True)
    trained, initial = H.safetensors_state(str(merged)), H.safetensors_state(str(source))
    assert sorted(trained) == sorted(initial)  # the MTP layer is written back
    for name in ("model.layers.3.eh_proj.weight", "model.layers.3.self_attn.kv_b_proj.weight",
                 "model.layers.3.mlp.gate.e_score_correction_bias"):
        assert not torch.equal(trained[name], initial[name]), name  # merged / balanced
    for name in ("model.layers.3.enorm.weight", "model.layers.3.hnorm.weight",
                 "model.layers.3.mlp.shared_experts.up_proj.weight"):
        assert torch.equal(trained[name], initial[name]), name  # frozen, not targeted
    tokens = H.tokens(length=33)
    assert abs(_mtp_loss(load_model(str(merged), log=lambda line: None).model, tokens)
               - _mtp_loss(loaded.model, tokens)) < 1e-5
    with pytest.raises(ArgumentError, match=r"^--to_peft: --model .* moved its routers' "
                                            r"expert bias in training"):
        H.convert(checkpoint, tmp_path / "peft", "to_peft")

    got = resumed_in_a_process(flags, out, again)
    assert sorted(got) == [3]
    assert (got[3]["loss"], got[3]["mtp_loss"]) == (ref[3]["loss"], ref[3]["mtp_loss"])
    resumed = load_model(str(again / "checkpoint" / "iter_0000003"),
                         log=lambda line: None).model.state_dict()
    kept = [k for k, v in state.items() if isinstance(v, torch.Tensor)
            and (".lora_" in k or k.endswith("router.expert_bias"))]
    assert "mtp.layers.0.transformer_layer.mlp.router.expert_bias" in kept
    for key in kept:
        assert torch.equal(resumed[key], state[key]), key


def test_peft_adapter_names_the_mtp_layers_adapters_as_the_folder_names_the_layer(
        folder, tmp_path, gloo_group):
    """--to_peft of a LoRA model with the folder's MTP layer: its adapters are written under
    the folder's names of the MTP layer (model.layers.<num_hidden_layers>.*; transformers
    builds no such module, so target_modules does not list eh_proj), and peft loads the
    adapter into transformers' model, leaving those out, to our logits."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from swift_mcore.arguments import RunArguments
    from swift_mcore.loaded_model import forward_logits
    from swift_mcore.models import lora
    from swift_mcore.models.convert import Layout
    from swift_mcore.models.gpt import build_model
    from swift_mcore.models.hf_load import load_hf_weights
    from swift_mcore.run_config import resolve

    family, source, _ = folder
    targets = MTP_LORA[MTP_LORA.index("--target_modules") + 1:]
    if family != "deepseek_v3":  # GLM-4.5: q/k/v attention
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "eh_proj"]
    config = resolve(RunArguments.from_flags(
        model=str(source), seq_length=32, mtp_num_layers=1, attention_backend="sdpa",
        tuner_type="lora", lora_rank=4, lora_alpha=16.0, lora_dropout=0.0,
        target_modules=targets), world_size=1).complete(300, None)
    model = build_model(config)
    load_hf_weights(config, model, log=lambda line: None)
    model = lora.apply(config, model)[0]
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # adapters as if trained
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    layout = Layout.from_model_args(config.model, config.padded_vocab_size)
    adapter_config, tensors = lora.peft_adapter(model, config.tuner, layout, str(source))
    layer = "model.layers.3."
    attention = (["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
                 if family == "deepseek_v3" else ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert adapter_config["target_modules"] == sorted(attention)
    for module in [f"{layer}eh_proj"] + [f"{layer}self_attn.{p}" for p in attention]:
        for factor in "AB":
            assert f"base_model.model.{module}.lora_{factor}.weight" in tensors, module
    assert not any(".experts." in k or ".mlp." in k for k in tensors)
    adapter = tmp_path / "peft"
    adapter.mkdir()
    save_file(tensors, str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
    (adapter / "adapter_config.json").write_text(json.dumps(adapter_config))

    from peft import PeftModel

    ids = H.tokens()
    ours = forward_logits(model.eval(), ids)
    base = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32,
                                                attn_implementation="eager")
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        theirs = PeftModel.from_pretrained(base, str(adapter)).eval()(input_ids=ids).logits
    assert (ours[..., : theirs.shape[-1]] - theirs).abs().max() <= 1e-4
    assert (plain - theirs).abs().max() > 1e-3


def _mtp_loss(model, tokens) -> float:
    """megatron's MTP loss of ``model`` on ``tokens`` (its tracker, in training mode)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    model.train()
    MTPLossLoggingHelper.tracker.clear()
    with torch.no_grad():
        model(input_ids=inputs, position_ids=torch.arange(inputs.shape[1])[None].expand(
            inputs.shape[0], -1), attention_mask=None, labels=labels)
    loss = float(MTPLossLoggingHelper.tracker["values"][0])
    MTPLossLoggingHelper.tracker.clear()
    return loss
