"""Gemma 3 text: a tiny random gemma3_text folder (sliding-window and global layers, a window
shorter than the sequence, norms off their init) gives transformers' logits; HF -> checkpoint
-> HF is bit-identical; packed rows give each document's own logits; sft trains and exports;
infer gives transformers' greedy tokens; what megatron cannot express is named."""

import json
import subprocess
import sys

import pytest
import torch

import hf_helpers as H
from run_helpers import ROOT, child_env, losses, train_records
from swift_mcore.errors import ArgumentError

WINDOW = 8
GEMMA3 = dict(head_dim=16, num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24,
              layer_types=["sliding_attention", "full_attention", "sliding_attention",
                           "full_attention"],
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "default",
                                                  "rope_theta": 1000000.0}})


def make_gemma3(path, **overrides):
    """A random gemma3_text model with every norm weight moved off its init (0)."""
    model = H.make_model(str(path), "gemma3_text", **{**GEMMA3, **overrides})
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(str(path))
    return model


def convert(source, out, direction, **flags):
    from swift_mcore.arguments.export import ExportArguments
    from swift_mcore.export import run

    args = ExportArguments(model=str(source), output_dir=str(out), **{direction: True}, **flags)
    return run(args.validate(), log=lambda line: None)


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3") / "hf"
    make_gemma3(path)
    return path


def test_logits_match_and_round_trip_is_bit_identical(tmp_path, gloo_group, gemma_folder,
                                                      monkeypatch):
    from swift_mcore.loaded_model import forward_logits, load_model
    from swift_mcore.models import sdpa_attention

    ids = H.tokens(length=4 * WINDOW)
    loaded = load_model(str(gemma_folder), log=lambda line: None)
    m = loaded.config.model
    assert (m.model_type, m.window_size, m.window_attn_skip_freq, m.rotary_base_local,
            m.rotary_base) == ("gemma3", WINDOW, "[1,0,1,0]", 10000, 1000000)
    assert loaded.config.attention == "sdpa"
    theirs = H.hf_logits(str(gemma_folder), ids)
    ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    assert (ours - theirs).abs().max() <= 1e-4
    # the window matters here: attending over the whole sequence gives other logits
    monkeypatch.setattr(sdpa_attention, "window_mask",
                        lambda sq, sk, window, device: torch.ones(sq, sk, dtype=torch.bool)
                        .tril())
    assert (forward_logits(loaded.model, ids)[..., : loaded.vocab] - theirs).abs().max() > 1e-2
    monkeypatch.undo()

    checkpoint = tmp_path / "mcore"
    convert(gemma_folder, checkpoint, "to_mcore")
    back = tmp_path / "back"
    convert(checkpoint, back, "to_hf")
    original, exported = H.safetensors_state(str(gemma_folder)), H.safetensors_state(str(back))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    config = json.loads((back / "config.json").read_text())
    source = json.loads((gemma_folder / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    for key in ("layer_types", "sliding_window", "query_pre_attn_scalar", "rope_parameters",
                "hidden_activation", "tie_word_embeddings"):
        assert config[key] == source[key], key
    assert (H.hf_logits(str(back), ids) - theirs).abs().max() == 0


def test_linear_rope_scaling_of_the_global_layers(tmp_path, gloo_group):
    """Gemma 3 4B-27B: rope_type 'linear' (factor 8) on the full_attention layers only."""
    from swift_mcore.loaded_model import forward_logits, load_model
    from swift_mcore.models.families import by_name

    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
    make_gemma3(tmp_path / "hf", rope_parameters=rope)
    ids = H.tokens(length=4 * WINDOW)
    loaded = load_model(str(tmp_path / "hf"), log=lambda line: None)
    assert loaded.config.model.rotary_seq_len_interpolation_factor == 8.0
    ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    assert (ours - H.hf_logits(str(tmp_path / "hf"), ids)).abs().max() <= 1e-4
    written = by_name("gemma3").hf_config(loaded.config.model, loaded.vocab)
    assert written["rope_parameters"] == rope


def test_packed_rows_give_each_documents_logits(gloo_group, gemma_folder):
    """Two documents longer than the window in one row, kept apart by the block-causal mask
    the trainer builds: each gets the logits it has alone."""
    from swift_mcore.data.packing import block_causal_mask
    from swift_mcore.loaded_model import forward_logits, load_model

    loaded = load_model(str(gemma_folder), log=lambda line: None)
    first, second = H.tokens(batch=1, length=20, seed=1), H.tokens(batch=1, length=13, seed=2)
    row = torch.cat([first, second], dim=1)
    segments = torch.tensor([[0] * 20 + [1] * 13])
    with torch.no_grad():
        packed = loaded.model(input_ids=row, position_ids=torch.arange(33)[None],
                              attention_mask=block_causal_mask(segments)).float()
    alone = [forward_logits(loaded.model, doc) for doc in (first, second)]
    assert (packed[:, :20] - alone[0]).abs().max() <= 1e-5
    assert (packed[:, 20:] - alone[1]).abs().max() <= 1e-5


def test_infer_gives_transformers_greedy_tokens(gloo_group, capsys, gemma_folder):
    prompt = "def add(a, b):\n    return"  # longer than the window
    assert H.check_infer_is_greedy(gemma_folder, capsys, prompt, new_tokens=6) > WINDOW


def test_sft_trains_and_exports_to_transformers(tmp_path, gloo_group, gemma_folder):
    from transformers import AutoModelForCausalLM

    from swift_mcore.loaded_model import forward_logits, load_model
    from test_hf_training import run_flags

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"add {i}"},
        {"role": "assistant", "content": "def add(a, b): return a + b"}]}) + "\n"
        for i in range(32)))
    out = tmp_path / "sft"
    cmd = [sys.executable, "-m", "swift_mcore", "sft", *run_flags(), "--model",
           str(gemma_folder), "--dataset", str(data), "--template", "plain", "--seq_length",
           "64", "--packing", "--train_iters", "6", "--lr", "1e-2", "--min_lr", "1e-2",
           "--save_steps", "6", "--output_dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = train_records(out)
    assert len(records) == 6 and records[-1]["loss"] < 0.7 * records[0]["loss"]

    back = tmp_path / "back"
    convert(out / "checkpoint", back, "to_hf")
    hf = AutoModelForCausalLM.from_pretrained(str(back), attn_implementation="eager").eval()
    ids = H.tokens(length=4 * WINDOW)
    loaded = load_model(str(out / "checkpoint"), log=lambda line: None)
    with torch.no_grad():
        theirs = hf(ids).logits
    ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    assert (ours - theirs).abs().max() <= 1e-4
    exported, source = H.safetensors_state(str(back)), H.safetensors_state(str(gemma_folder))
    name = "model.layers.0.post_feedforward_layernorm.weight"
    assert not torch.equal(exported[name], source[name])


@pytest.mark.parametrize("change, message", [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping 50.0"),
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping 30.0"),
    (dict(hidden_activation="gelu"), "hidden_activation 'gelu'"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    # transformers' config class takes an integer only (and an export would write 20.5)
    (dict(query_pre_attn_scalar=20.5), "query_pre_attn_scalar 20.5 (an integer"),
    # Gemma 3's own keys are checked by value as the common ones (was int()'s ValueError)
    (dict(layer_types=None, sliding_window_pattern="x"),
     "sliding_window_pattern 'x' is a string"),
    (dict(sliding_window="8"), "sliding_window '8' is a string"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 8.0,
                                                 "rope_theta": 1e4},
                           "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
     "rope_parameters.sliding_attention.rope_type 'linear'"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                           "full_attention": {"rope_type": "yarn", "factor": 8.0,
                                              "rope_theta": 1e6}}),
     "rope_parameters.full_attention.rope_type 'yarn'"),
])
def test_what_megatron_cannot_express_is_named(tmp_path, gemma_folder, change, message):
    import shutil

    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve

    folder = tmp_path / "hf"
    shutil.copytree(gemma_folder, folder)
    H.edit_config(str(folder), **change)
    with pytest.raises(ArgumentError, match=message.replace("(", r"\(").replace(".", r"\.")):
        resolve(RunArguments.from_flags(model=str(folder)), world_size=1)


def test_a_vision_language_folder_without_its_language_model_is_refused_by_name(
        tmp_path, gemma_folder):
    """(test_multimodal_text.py trains the language model of one that holds it.)"""
    import shutil

    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve

    folder = tmp_path / "vl"
    shutil.copytree(gemma_folder, folder)
    text = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text, "vision_config": {"model_type": "siglip_vision_model"}}))
    with pytest.raises(ArgumentError, match=(
            rf"^--model {folder}: a gemma3 folder whose weights hold no language model's "
            rf"embedding")):
        resolve(RunArguments.from_flags(model=str(folder)), world_size=1)


def test_sliding_windows_refuse_a_backend_without_them(gemma_folder):
    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve

    with pytest.raises(ArgumentError, match="--attention_backend local with --window_size 8"):
        resolve(RunArguments.from_flags(model=str(gemma_folder), attention_backend="local"),
                world_size=1)
    with pytest.raises(ArgumentError, match="--window_attn_skip_freq needs --window_size"):
        resolve(RunArguments.from_flags(window_attn_skip_freq="2"), world_size=1)


def test_the_post_norms_are_summed_over_tp_ranks_under_sequence_parallelism(gemma_folder):
    """With --sequence_parallel each rank's post-attention and post-MLP norms see its slice
    of the sequence: their weights carry megatron's sequence_parallel mark (what
    finalize_model_grads sums over the TP ranks), as the layer's other norms do."""
    from swift_mcore.arguments import RunArguments
    from swift_mcore.models import gemma3_layers
    from swift_mcore.run_config import resolve

    def post_norms(**flags):
        config = resolve(RunArguments.from_flags(model=str(gemma_folder), **flags),
                         world_size=flags.get("tensor_model_parallel_size", 1))
        spec = gemma3_layers.adapt_spec(_local_spec(), config)
        built = [slot.module(**slot.params).post_norm.weight
                 for slot in (spec.submodules.self_attn_bda, spec.submodules.mlp_bda)]
        return [getattr(weight, "sequence_parallel", None) for weight in built]

    assert post_norms(tensor_model_parallel_size=2, sequence_parallel=True) == [True, True]
    assert post_norms() == [False, False]


def _local_spec():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")


@pytest.mark.benchmark
def test_tp2_sequence_parallel_gives_the_one_rank_losses(tmp_path, train_here, gemma_folder):
    """pt for 4 steps at TP=2 with --sequence_parallel gives the one-rank losses within 1e-5
    and their gradient norms within 1e-5 of each: the four norms of every layer (the
    post-attention and post-MLP ones in the bias-dropout-add slots too) see a slice of the
    sequence and their gradients are summed over the TP ranks. A high learning rate: Adam's step barely
    depends on a gradient's scale, so unsummed norm gradients show where their sign
    differs."""
    from test_hf_training import continue_pretraining, run_flags

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(100)))
    flags = ["--seq_length", "32", "--lr", "1e-2", "--min_lr", "1e-2", "--no_save"]
    one, sp = tmp_path / "one", tmp_path / "sp"
    train_here(one, "--model", gemma_folder, "--dataset", data, "--train_iters", "4", *flags,
               command="pt", base=run_flags())
    continue_pretraining(gemma_folder, data, sp, *flags, "--tensor_model_parallel_size", "2",
                         "--sequence_parallel", nproc=2)
    ref, got = losses(one), losses(sp)
    assert sorted(got) == [1, 2, 3, 4] and ref[4] != ref[1]
    for it in ref:
        assert abs(got[it] - ref[it]) <= 1e-5, (it, got[it], ref[it])
    norms = zip(train_records(one), train_records(sp))  # the first one is about 4e5 here
    assert all(abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"] for a, b in norms)


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_tp_and_pp_match_transformers_and_export_bit_identical(tmp_path, gloo_group, tp, pp):
    """TP=2 (the post-norms after the all-reduced projections) and PP=2 (window layers and
    their RoPE base found by the global layer number) on gloo."""
    from test_hf_parallel import run_two_ranks

    make_gemma3(tmp_path / "hf")
    ids, out = run_two_ranks(tmp_path, tmp_path / "hf", tp, pp)
    assert (torch.load(out / "logits.pt") - H.hf_logits(str(tmp_path / "hf"), ids)).abs().max() \
        <= 1e-4
    convert(out, tmp_path / "exported", "to_hf")
    original = H.safetensors_state(str(tmp_path / "hf"))
    back = H.safetensors_state(str(tmp_path / "exported"))
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[name], tensor) for name, tensor in original.items())


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path, train_here, gemma_folder):
    """pt on the folder for 4 steps saving at 2; resumed from step 2 it logs steps 3 and 4
    exactly (the windows, both RoPE tables and the norms restored from the checkpoint)."""
    from test_hf_training import run_flags

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(100)))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    flags = ["--model", gemma_folder, "--dataset", data, "--seq_length", "32", "--lr", "1e-2",
             "--train_iters", "4"]
    train_here(straight, *flags, "--save_steps", "2", command="pt", base=run_flags())
    train_here(resumed, *flags, "--no_save", "--resume",
               straight / "checkpoint" / "iter_0000002", command="pt", base=run_flags())
    ref, got = losses(straight), losses(resumed)
    assert sorted(got) == [3, 4] and ref[4] != ref[1]
    assert all(got[it] == ref[it] for it in (3, 4)), (got, ref)


def test_a_transformers_4_config_reads_as_transformers_5_does():
    """The Hub's Gemma 3 configs (transformers 4.5x): sliding_window_pattern,
    rope_local_base_freq, rope_theta and the global layers' rope_scaling; transformers 5
    reads them into the same layer_types and per-kind RoPE."""
    from transformers import Gemma3TextConfig

    from swift_mcore.models.families import by_name

    old = dict(H.BASE, model_type="gemma3_text", head_dim=16, num_hidden_layers=7,
               sliding_window=512, sliding_window_pattern=3, rope_local_base_freq=10000.0,
               rope_theta=1000000.0, rope_scaling={"factor": 8.0, "rope_type": "linear"},
               query_pre_attn_scalar=168, cache_implementation="hybrid")
    values = by_name("gemma3").model_values(old, None)
    hf = Gemma3TextConfig(**{k: v for k, v in old.items() if k != "model_type"})
    assert values["window_attn_skip_freq"] == "[" + ",".join(
        "1" if kind == "sliding_attention" else "0" for kind in hf.layer_types) + "]" \
        == "[1,1,0,1,1,0,1]"
    assert (values["rotary_base_local"], values["rotary_base"]) == (
        hf.rope_parameters["sliding_attention"]["rope_theta"],
        hf.rope_parameters["full_attention"]["rope_theta"])
    assert values["rotary_seq_len_interpolation_factor"] == \
        hf.rope_parameters["full_attention"]["factor"] == 8.0
    assert values["softmax_scale"] == 168 ** -0.5 and values["window_size"] == 512
    # and written back as they were read (168 ** -0.5 back to 168)
    from swift_mcore.arguments.model import ModelArguments

    written = by_name("gemma3").hf_config(ModelArguments(**values), 320)
    assert written["query_pre_attn_scalar"] == 168 and written["layer_types"] == hf.layer_types
    assert written["rope_parameters"] == {k: dict(v) for k, v in hf.rope_parameters.items()}


PER_KIND = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}


@pytest.mark.parametrize("config", [
    # no head_dim: transformers' 256, not hidden_size / heads (was a shape AssertionError)
    dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    # _sliding_window_pattern (the attribute's name) does not set the layers: the default 6
    dict(num_hidden_layers=4, head_dim=16, _sliding_window_pattern=2),
    # rope_scaling updates the full_attention layers' per-kind RoPE (it was ignored)
    dict(num_hidden_layers=4, head_dim=16, rope_parameters=PER_KIND,
         rope_scaling={"rope_type": "linear", "factor": 4.0}),
    # a kind without rope_theta takes rope_theta / rope_local_base_freq (was the default)
    dict(num_hidden_layers=4, head_dim=16, rope_theta=50000.0, rope_local_base_freq=500.0,
         rope_parameters={"sliding_attention": {"rope_type": "default"},
                          "full_attention": {"rope_type": "default"}}),
], ids=["no-head_dim", "_sliding_window_pattern", "rope_scaling-over-per-kind",
        "per-kind-without-theta"])
def test_config_keys_read_as_transformers_reads_them(config):
    from transformers import Gemma3TextConfig

    from swift_mcore.models.families import by_name

    config = dict(H.BASE, model_type="gemma3_text", sliding_window=8, **config)
    values = by_name("gemma3").model_values(config, None)
    hf = Gemma3TextConfig(**{k: v for k, v in config.items() if k != "model_type"})
    assert values["kv_channels"] == hf.head_dim
    kinds = ["1" if kind == "sliding_attention" else "0" for kind in hf.layer_types]
    assert values["window_attn_skip_freq"] == ("[" + ",".join(kinds) + "]" if "1" in kinds
                                               else None)
    rope = hf.rope_parameters
    assert values["rotary_base"] == rope["full_attention"]["rope_theta"]
    if "1" in kinds:
        assert values["rotary_base_local"] == rope["sliding_attention"]["rope_theta"]
    assert values["rotary_seq_len_interpolation_factor"] == rope["full_attention"].get("factor")


def test_a_softmax_scale_of_no_integer_scalar_is_not_exported():
    """query_pre_attn_scalar is an integer in transformers' Gemma3TextConfig: a
    --softmax_scale whose ** -2 is none is named (the export wrote a config.json transformers
    refuses to load)."""
    from swift_mcore.arguments.model import ModelArguments
    from swift_mcore.models.families import by_name

    config = dict(H.BASE, model_type="gemma3_text", **GEMMA3)
    family = by_name("gemma3")
    m = ModelArguments(**family.model_values(config, None))
    assert family.representation_problems(m) == []
    assert family.hf_config(m, 320)["query_pre_attn_scalar"] == 24
    m.softmax_scale = 0.3
    assert [p for p in family.representation_problems(m) if p.startswith("--softmax_scale")] \
        == ["--softmax_scale 0.3 (a gemma3 config.json holds query_pre_attn_scalar, an integer, "
            "as softmax_scale ** -2: here 11.1111)"]


def test_lora_trains_and_exports_merged_and_as_peft(tmp_path, train_here, gloo_group,
                                                    gemma_folder):
    """LoRA on every linear layer: the merged export and the PEFT adapter on the base
    folder give the trained model's logits in transformers."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from swift_mcore.loaded_model import forward_logits, load_model
    from test_hf_training import run_flags

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(100)))
    out = tmp_path / "lora"
    train_here(out, "--model", gemma_folder, "--dataset", data, "--seq_length", "32",
               "--lr", "1e-2", "--train_iters", "3", "--tuner_type", "lora", "--lora_rank",
               "4", command="pt", base=run_flags())
    checkpoint = out / "checkpoint"
    convert(checkpoint, tmp_path / "merged", "to_hf", merge_lora=True)
    convert(checkpoint, tmp_path / "adapter", "to_peft")
    ids = H.tokens(length=4 * WINDOW)
    loaded = load_model(str(checkpoint), log=lambda line: None)
    ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    base = H.hf_logits(str(gemma_folder), ids)
    assert (ours - base).abs().max() > 1e-3  # the adapters learned something
    assert (H.hf_logits(str(tmp_path / "merged"), ids) - ours).abs().max() <= 1e-4
    model = AutoModelForCausalLM.from_pretrained(str(gemma_folder),
                                                 attn_implementation="eager")
    peft = PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        assert (peft(ids).logits - ours).abs().max() <= 1e-4


def test_a_mistral_window_shorter_than_the_sequence_is_exact(tmp_path, gloo_group):
    """Mistral's sliding_window below --seq_length becomes --window_size (SDPA's window):
    transformers' logits on a sequence four windows long, and the window written back."""
    from swift_mcore.loaded_model import forward_logits, load_model

    H.make_family(str(tmp_path / "hf"), "mistral", sliding_window=WINDOW)
    ids = H.tokens(length=4 * WINDOW)
    loaded = load_model(str(tmp_path / "hf"), log=lambda line: None)
    assert loaded.config.model.window_size == WINDOW and loaded.config.attention == "sdpa"
    ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    assert (ours - H.hf_logits(str(tmp_path / "hf"), ids)).abs().max() <= 1e-4
    convert(tmp_path / "hf", tmp_path / "mcore", "to_mcore")
    convert(tmp_path / "mcore", tmp_path / "back", "to_hf")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["sliding_window"] == WINDOW
    assert (H.hf_logits(str(tmp_path / "back"), ids) - ours).abs().max() <= 1e-4


@pytest.mark.benchmark
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_cp2_gives_the_one_rank_losses_and_gradient_norms(tmp_path, gemma_folder, packing):
    """--context_parallel_size 2: the window layers (their own RoPE base, cut to each rank's
    chunks like the global layers') and the global layers over the gathered keys give the
    one-rank sft run, padded and with packed rows."""
    from run_helpers import train_records
    from test_hf_training import train_from_hf
    from test_moe_training import write_chat

    data = tmp_path / "chat.jsonl"
    write_chat(data, 32, varied=True)
    flags = ["--template", "plain", "--seq_length", "64", "--train_iters", "3", "--lr", "1e-2",
             "--min_lr", "1e-2", "--no_save", "--hidden_dropout", "0", "--attention_dropout",
             "0", *(["--packing"] if packing else [])]
    outs = {}
    for name, extra, nproc in (("one", [], 1), ("cp2", ["--context_parallel_size", "2"], 2)):
        train_from_hf("sft", gemma_folder, data, tmp_path / name, *flags, *extra, nproc=nproc,
                      timeout=600)
        outs[name] = train_records(tmp_path / name)
    assert [r["iteration"] for r in outs["cp2"]] == [1, 2, 3]
    for ref, got in zip(outs["one"], outs["cp2"]):
        for key in ("loss", "grad_norm"):
            assert abs(got[key] - ref[key]) <= 1e-5, (ref["iteration"], key, got[key], ref[key])
