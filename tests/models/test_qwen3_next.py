"""Qwen3-Next: a tiny random qwen3_next folder (three gated delta-net layers and one gated
full-attention layer, routed experts with a gated shared expert, every weight off its init)
gives transformers' logits; HF -> checkpoint -> HF is bit-identical; infer gives
transformers' greedy tokens; packed rows give each document's own logits; sft trains and
exports; resume is exact; what megatron cannot express is named."""

import pytest
import torch

import hf_helpers as H
from swift_mcore.errors import ArgumentError

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU delta rule")

NEXT = dict(num_hidden_layers=4, head_dim=16, partial_rotary_factor=0.5,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
            # half the other families' width: with 0.2 the delta nets' states grow large
            # enough that float32 rounding alone (transformers' and ours) nears 1e-4 by
            # 200 tokens
            initializer_range=0.1)


def make_next(path, **overrides):
    """A random qwen3_next model with every weight moved off its init (norms start at 0,
    dt_bias at 1, the router at 0)."""
    model = H.make_model(str(path), "qwen3_next", **{**NEXT, **overrides})
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "dt_bias" in name or "A_log" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def next_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next") / "hf"
    make_next(path)
    return path


def test_logits_match_and_round_trip_is_bit_identical(tmp_path, gloo_group, next_folder):
    from swift_mcore.loaded_model import forward_logits, load_model

    ids = H.tokens(length=80)  # over one 64-token chunk of the delta rule
    loaded = load_model(str(next_folder), log=lambda line: None)
    m = loaded.config.model
    assert (m.model_type, m.linear_attention_freq, m.attention_output_gate,
            m.rotary_percent) == ("qwen3_next", "[1,1,1,0]", True, 0.5)
    theirs = H.hf_logits(str(next_folder), ids)
    ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    assert (ours - theirs).abs().max() <= 1e-4
    H.check_round_trip(next_folder, tmp_path)


def test_infer_is_transformers_greedy(gloo_group, next_folder, capsys):
    H.check_infer_is_greedy(next_folder, capsys)


def packed_documents(lengths):
    """Random documents of ``lengths`` (one list per row) packed into rows: the documents,
    the rows' tokens, and their segment and position ids as sft --packing makes them."""
    docs = [[H.tokens(batch=1, length=n, seed=10 * r + i) for i, n in enumerate(row)]
            for r, row in enumerate(lengths)]
    rows = torch.cat([torch.cat(row, dim=1) for row in docs], dim=0)
    segments = torch.tensor([sum(([i] * n for i, n in enumerate(row)), []) for row in lengths])
    positions = torch.tensor([sum((list(range(n)) for n in row), []) for row in lengths])
    return docs, rows, segments, positions


def assert_each_document_alone(logits, docs, model, within=1e-5):
    """Each document's slice of the packed rows' logits is its logits alone (``within``), and
    its next-token loss its loss alone within 1e-5."""
    import torch.nn.functional as F

    from swift_mcore.loaded_model import forward_logits

    def loss(doc_logits, doc):
        return F.cross_entropy(doc_logits[0, :-1].float(), doc[0, 1:])

    for r, row in enumerate(docs):
        start = 0
        for doc in row:
            alone = forward_logits(model, doc)[..., : logits.shape[-1]]
            stop = start + doc.shape[1]
            assert (logits[r:r + 1, start:stop] - alone).abs().max() <= within
            assert abs(loss(logits[r:r + 1, start:stop], doc) - loss(alone, doc)) <= 1e-5
            start = stop


def test_packed_rows_give_each_documents_logits(gloo_group, next_folder, monkeypatch):
    """Documents packed into rows (different bounds per row), kept apart by the block-causal
    mask the trainer builds: each gets the logits it has alone, through the delta nets'
    conv and recurrence as through the attention."""
    from swift_mcore.data.packing import block_causal_mask
    from swift_mcore.loaded_model import load_model
    from swift_mcore.models import hybrid_layers

    loaded = load_model(str(next_folder), log=lambda line: None)
    docs, rows, segments, positions = packed_documents([[20, 13, 7], [30, 10]])

    def packed():
        with torch.no_grad():
            return loaded.model(input_ids=rows, position_ids=positions,
                                attention_mask=block_causal_mask(segments)).float()

    logits = packed()
    assert_each_document_alone(logits, docs, loaded.model)
    # megatron's layer alone (the mask ignored) lets the state run into the next document
    monkeypatch.setattr(hybrid_layers, "document_starts", lambda mask, batch: None)
    assert (packed()[:, 20:] - logits[:, 20:]).abs().max() > 1e-3


def test_a_sequence_parallel_rank_cuts_documents_out_of_the_whole_row(gloo_group,
                                                                       next_folder):
    """One delta-net layer as a rank of TP=2 with --sequence_parallel sees it (on one
    process): its input is its half of the packed row, in_proj gathers the whole row, and
    out_proj keeps its half of the output. Documents straddling the halves (13..33 of 40,
    0..30) come out as in the whole row's one-rank forward: the documents are cut out of the
    gathered row, not out of the rank's half. (The benchmark test below runs two ranks.)"""
    from swift_mcore.data.packing import block_causal_mask
    from swift_mcore.loaded_model import load_model

    layer = load_model(str(next_folder), log=lambda line: None).model.decoder.layers[0] \
        .self_attention
    _, _, segments, _ = packed_documents([[13, 20, 7], [30, 10]])
    mask = block_causal_mask(segments)
    row = torch.randn(40, 2, layer.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole = layer(row, mask)[0]
    in_proj, out_proj = layer.in_proj, layer.out_proj

    class Gather(torch.nn.Module):  # the row's other half comes from the other rank
        def forward(self, half):
            assert torch.equal(half, row[mine])
            return in_proj(row)

    class Scatter(torch.nn.Module):  # each rank keeps its half of the summed output
        def forward(self, x):
            out, bias = out_proj(x)
            return out[mine], bias

    try:
        layer.in_proj, layer.out_proj, layer.sp_size = Gather(), Scatter(), 2
        for mine in (slice(0, 20), slice(20, 40)):
            with torch.no_grad():
                half = layer(row[mine], mask)[0]
            assert (half - whole[mine]).abs().max() <= 1e-6
    finally:
        layer.in_proj, layer.out_proj, layer.sp_size = in_proj, out_proj, 1


def test_packing_resolves_at_tensor_parallel_size_two(tmp_path):
    """sft --packing with delta-net layers at TP=2 with --sequence_parallel is a run (the
    delta nets cut documents out of the whole gathered row: the benchmark test below)."""
    from swift_mcore.arguments import SftArguments
    from swift_mcore.run_config import resolve

    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a b"}\n')
    config = resolve(SftArguments.from_flags(
        model_type="qwen3_next", linear_attention_freq="[1,0]", num_layers=2, hidden_size=64,
        num_attention_heads=4, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, dataset=[str(data)], packing=True,
        tensor_model_parallel_size=2, sequence_parallel=True), world_size=2)
    assert config.parallel.tensor_model_parallel_size == 2 and config.sft.packing


@pytest.mark.benchmark
def test_packed_rows_under_tensor_and_sequence_parallelism(tmp_path, gloo_group, next_folder):
    """TP=2 with --sequence_parallel on packed rows whose documents straddle the ranks'
    halves of the row (13..33 of 40, 0..30): each rank's delta nets cut the documents out of
    the whole gathered row, so every document gets its loss alone within 1e-5, and the rows
    the single-rank packed forward's logits (within 1e-4: the TP ranks sum in another
    order; a leak across documents moves them by over 1e-3)."""
    from swift_mcore.data.packing import block_causal_mask
    from swift_mcore.loaded_model import load_model
    from test_hf_parallel import run_two_ranks

    docs, rows, segments, positions = packed_documents([[13, 20, 7], [30, 10]])
    torch.save((segments, positions), tmp_path / "packed.pt")
    _, out = run_two_ranks(tmp_path, next_folder, 2, 1, "--sequence_parallel", "--packed",
                           str(tmp_path / "packed.pt"), ids=rows)
    logits = torch.load(out / "logits.pt")
    loaded = load_model(str(next_folder), log=lambda line: None)
    with torch.no_grad():
        one_rank = loaded.model(input_ids=rows, position_ids=positions,
                                attention_mask=block_causal_mask(segments)).float()
    assert (logits - one_rank[..., : logits.shape[-1]]).abs().max() <= 1e-4
    assert_each_document_alone(logits, docs, loaded.model, within=1e-4)


@pytest.mark.benchmark
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_tp_and_pp_match_transformers_and_export_bit_identical(tmp_path, gloo_group, tp, pp):
    """TP=2 (each rank whole key heads and their value heads of every delta net, with
    sequence parallelism) and PP=2 (each stage its slice of the layer pattern) on gloo."""
    from test_hf_parallel import run_two_ranks

    make_next(tmp_path / "hf")
    extra = ("--sequence_parallel",) if tp > 1 else ()
    ids, out = run_two_ranks(tmp_path, tmp_path / "hf", tp, pp, *extra)
    assert (torch.load(out / "logits.pt") - H.hf_logits(str(tmp_path / "hf"), ids)).abs().max() \
        <= 1e-4
    H.convert(out, tmp_path / "exported", "to_hf")
    original = H.safetensors_state(str(tmp_path / "hf"))
    back = H.safetensors_state(str(tmp_path / "exported"))
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[name], tensor) for name, tensor in original.items())


def test_sft_trains_and_exports_to_transformers(tmp_path, gloo_group, next_folder):
    """sft with --packing for 6 steps (every weight trains, the delta nets' included); the
    exported folder gives the checkpoint's logits in transformers."""
    import json
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from run_helpers import ROOT, child_env, train_records
    from swift_mcore.loaded_model import forward_logits, load_model
    from test_hf_training import run_flags

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"add {i}"},
        {"role": "assistant", "content": "def add(a, b): return a + b"}]}) + "\n"
        for i in range(32)))
    out = tmp_path / "sft"
    cmd = [sys.executable, "-m", "swift_mcore", "sft", *run_flags(), "--model",
           str(next_folder), "--dataset", str(data), "--template", "plain", "--seq_length",
           "64", "--packing", "--train_iters", "6", "--lr", "1e-2", "--min_lr", "1e-2",
           "--save_steps", "6", "--output_dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = train_records(out)
    assert len(records) == 6 and records[-1]["loss"] < 0.7 * records[0]["loss"]

    back = tmp_path / "back"
    H.convert(out / "checkpoint", back, "to_hf")
    hf = AutoModelForCausalLM.from_pretrained(str(back), attn_implementation="eager").eval()
    ids = H.tokens(length=40)
    loaded = load_model(str(out / "checkpoint"), log=lambda line: None)
    with torch.no_grad():
        theirs = hf(ids).logits
    ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    assert (ours - theirs).abs().max() <= 1e-4
    exported, source = H.safetensors_state(str(back)), H.safetensors_state(str(next_folder))
    for name in ("model.layers.0.linear_attn.in_proj_qkvz.weight",
                 "model.layers.0.linear_attn.A_log", "model.layers.3.self_attn.q_proj.weight"):
        assert not torch.equal(exported[name], source[name]), name


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path, train_here, next_folder):
    """pt on the folder for 4 steps saving at 2; resumed from step 2 it logs steps 3 and 4
    exactly (the delta nets' conv, dt_bias, A_log and norms restored)."""
    import json

    from run_helpers import losses
    from test_hf_training import run_flags

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(100)))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    flags = ["--model", next_folder, "--dataset", data, "--seq_length", "32", "--lr", "1e-2",
             "--train_iters", "4"]
    train_here(straight, *flags, "--save_steps", "2", command="pt", base=run_flags())
    train_here(resumed, *flags, "--no_save", "--resume",
               straight / "checkpoint" / "iter_0000002", command="pt", base=run_flags())
    ref, got = losses(straight), losses(resumed)
    assert sorted(got) == [3, 4] and ref[4] != ref[1]
    assert all(got[it] == ref[it] for it in (3, 4)), (got, ref)


@pytest.mark.parametrize("change, message", [
    (dict(mtp_num_hidden_layers=2), "mtp_num_hidden_layers 2"),
    (dict(mtp_use_dedicated_embeddings=True), "mtp_use_dedicated_embeddings true"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads 3"),
    (dict(attention_bias=True), "attention_bias True"),
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention",
                       "full_attention"]), "layer_types"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                           "partial_rotary_factor": 0.3}), "partial_rotary_factor 0.3"),
    (dict(linear_conv_kernel_dim="4"), "linear_conv_kernel_dim '4' is a string"),
])
def test_what_megatron_cannot_express_is_named(tmp_path, next_folder, change, message):
    import re
    import shutil

    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve

    folder = tmp_path / "hf"
    shutil.copytree(next_folder, folder)
    H.edit_config(str(folder), **change)
    with pytest.raises(ArgumentError, match=re.escape(message)):
        resolve(RunArguments.from_flags(model=str(folder)), world_size=1)


def test_a_transformers_4_config_reads_as_transformers_5_does():
    """Qwen3-Next's Hub configs: full_attention_interval, top-level partial_rotary_factor and
    rope_theta; transformers 5 reads them into the same layer_types and rotary fraction,
    and they are written back in transformers 5's spelling."""
    from transformers import Qwen3NextConfig

    from swift_mcore.arguments.model import ModelArguments
    from swift_mcore.models.families import by_name

    old = {**H.BASE, **{k: v for k, v in NEXT.items() if k != "layer_types"}}
    old.update(model_type="qwen3_next", num_hidden_layers=8, full_attention_interval=4,
               partial_rotary_factor=0.25, rope_theta=10000000)
    values = by_name("qwen3_next").model_values(old, None)
    hf = Qwen3NextConfig(**{k: v for k, v in old.items() if k != "model_type"})
    assert values["linear_attention_freq"] == "[" + ",".join(
        "1" if kind == "linear_attention" else "0" for kind in hf.layer_types) + "]" \
        == "[1,1,1,0,1,1,1,0]"
    assert values["rotary_percent"] == hf.rope_parameters["partial_rotary_factor"] == 0.25
    assert values["rotary_base"] == hf.rope_parameters["rope_theta"]
    written = by_name("qwen3_next").hf_config(ModelArguments(**values), 320)
    assert written["layer_types"] == hf.layer_types
    assert written["rope_parameters"]["partial_rotary_factor"] == 0.25


def test_rope_scaling_is_read_in_place_of_rope_parameters():
    """transformers reads a given rope_scaling in place of rope_parameters (its base, its
    rotary fraction); it was ignored beside rope_parameters."""
    from transformers import Qwen3NextConfig

    from swift_mcore.models.families import by_name

    config = {**H.BASE, **NEXT, "model_type": "qwen3_next",
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.5},
              "rope_scaling": {"rope_type": "default", "rope_theta": 500.0,
                               "partial_rotary_factor": 0.25}}
    values = by_name("qwen3_next").model_values(config, None)
    hf = Qwen3NextConfig(**{k: v for k, v in config.items() if k != "model_type"})
    assert values["rotary_base"] == hf.rope_parameters["rope_theta"] == 500
    assert values["rotary_percent"] == hf.rope_parameters["partial_rotary_factor"] == 0.25


def test_a_gpu_without_the_delta_net_kernels_is_refused_by_name(next_folder, monkeypatch):
    """On CUDA megatron's GatedDeltaNet needs flash-linear-attention: refused before any work
    (a simulated GPU without it), not a traceback from the layer."""
    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve
    from swift_mcore.runtime import hardware

    monkeypatch.setattr(hardware, "flash_linear_attention_available", lambda: False)
    with pytest.raises(ArgumentError, match="pip install flash-linear-attention"):
        resolve(RunArguments.from_flags(model=str(next_folder)), world_size=1, cuda=True,
                transformer_engine=False)


def test_lora_on_the_delta_nets_exports_merged_and_as_peft(tmp_path, train_here,
                                                          next_folder):
    """LoRA on the delta nets' in_proj and out_proj alone (the attention layer's linear_qkv
    and linear_proj too with all-linear): the adapters train; the merged export, and the
    PEFT adapter (in_proj's A on in_proj_qkvz and in_proj_ba, its B split into their rows in
    transformers' per-key-head order) loaded by peft onto transformers' model, give the
    checkpoint's logits within 1e-4."""
    import json

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from swift_mcore.loaded_model import forward_logits, load_model
    from test_hf_training import run_flags

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(100)))
    out = tmp_path / "lora"
    train_here(out, "--model", next_folder, "--dataset", data, "--seq_length", "32",
               "--lr", "1e-2", "--train_iters", "3", "--tuner_type", "lora", "--lora_rank",
               "4", "--target_modules", "in_proj,out_proj", command="pt", base=run_flags())
    checkpoint = out / "checkpoint"
    loaded = load_model(str(checkpoint), log=lambda line: None)
    adapted = sorted({name.rsplit(".lora_", 1)[0] for name, _ in
                      loaded.model.named_parameters() if ".lora_" in name})
    assert adapted == [f"decoder.layers.{i}.self_attention.{p}" for i in range(3)
                       for p in ("in_proj", "out_proj")]  # layer 3 is full attention
    H.convert(checkpoint, tmp_path / "merged", "to_hf", merge_lora=True)
    ids = H.tokens(length=40)
    ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    assert (ours - H.hf_logits(str(next_folder), ids)).abs().max() > 1e-3  # it learned
    assert (H.hf_logits(str(tmp_path / "merged"), ids) - ours).abs().max() <= 1e-4
    merged = load_file(str(tmp_path / "merged" / "model.safetensors")) \
        if (tmp_path / "merged" / "model.safetensors").exists() \
        else H.safetensors_state(str(tmp_path / "merged"))
    source = H.safetensors_state(str(next_folder))
    assert not torch.equal(merged["model.layers.0.linear_attn.in_proj_ba.weight"],
                           source["model.layers.0.linear_attn.in_proj_ba.weight"])
    assert torch.equal(merged["model.layers.3.self_attn.q_proj.weight"],
                       source["model.layers.3.self_attn.q_proj.weight"])

    H.convert(checkpoint, tmp_path / "adapter", "to_peft")
    written = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert sorted({name.split(".linear_attn.")[1] for name in written}) == [
        f"{module}.lora_{ab}.weight" for module in ("in_proj_ba", "in_proj_qkvz", "out_proj")
        for ab in "AB"]
    base = AutoModelForCausalLM.from_pretrained(str(next_folder), attn_implementation="eager")
    peft = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        assert (peft(ids).logits - ours).abs().max() <= 1e-4


@pytest.mark.parametrize("flags, message", [
    (dict(tensor_model_parallel_size=2), "needs --sequence_parallel"),
    (dict(attention_backend="transformer_engine"),
     "--attention_backend transformer_engine with gated delta-net layers"),
    (dict(linear_num_key_heads=3, linear_num_value_heads=6, tensor_model_parallel_size=2,
          sequence_parallel=True), "must divide --linear_num_key_heads (3)"),
])
def test_what_the_delta_net_layers_cannot_run_is_named(flags, message):
    import re

    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve

    base = dict(model_type="qwen3_next", linear_attention_freq="[1,0]", num_layers=2,
                hidden_size=64, num_attention_heads=4, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
    gpu = flags.get("attention_backend") == "transformer_engine"  # a GPU with TE, simulated
    with pytest.raises(ArgumentError, match=re.escape(message)):
        resolve(RunArguments.from_flags(**{**base, **flags}),
                world_size=flags.get("tensor_model_parallel_size", 1), cuda=gpu,
                transformer_engine=gpu)
