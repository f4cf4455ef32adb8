"""DeepSeek-V3 (multi-latent attention, YaRN, sigmoid group-limited routing with an expert
bias, shared experts, a dense first layer): a tiny random folder whose routing spreads tokens
over experts and groups and whose norms and biases are off their init gives transformers'
logits; HF -> swift-mcore -> HF is bit-identical; what megatron cannot express is named."""

import json

import pytest
import torch

import hf_helpers as H
from swift_mcore.errors import ArgumentError

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
        "rope_theta": 10000.0}
# eight experts in four groups, two groups per token, top-2; the first layer dense
DEEPSEEK = dict(n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                moe_intermediate_size=32, n_group=4, topk_group=1, first_k_dense_replace=1,
                q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=24, num_key_value_heads=4, routed_scaling_factor=2.5,
                rope_parameters=YARN, num_hidden_layers=3)


def make_deepseek(path, **overrides):
    """A random model with every norm weight and the routers' correction bias off init."""
    model = H.make_model(str(path), "deepseek_v3", **{**DEEPSEEK, **overrides})
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn(buffer.shape, generator=generator))
    model.save_pretrained(str(path))
    return model


convert = H.convert


@pytest.mark.parametrize("q_lora_rank", [48, None])
def test_logits_match_and_round_trip_is_bit_identical(tmp_path, gloo_group, q_lora_rank):
    from swift_mcore.loaded_model import forward_logits, load_model

    source = tmp_path / "hf"
    hf_model = make_deepseek(source, q_lora_rank=q_lora_rank)
    ids = H.tokens()
    with torch.no_grad():  # the routing spreads: every expert is some token's choice
        router = hf_model.model.layers[2].mlp.gate
        hidden = torch.randn(128, 64, generator=torch.Generator().manual_seed(2))
        _, _, chosen = router(hidden)
    assert len(set(chosen.flatten().tolist())) == 8

    loaded = load_model(str(source), log=lambda line: None)
    ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    theirs = H.hf_logits(str(source), ids)
    assert (ours - theirs).abs().max() <= 1e-4
    m = loaded.config.model
    assert (m.model_type, m.num_experts, m.moe_router_topk, m.moe_layer_freq) == (
        "deepseek_v3", 8, 2, "[0,1,1]")
    assert m.multi_latent_attention and m.rope_type == "yarn" and m.q_lora_rank == q_lora_rank

    config = H.check_round_trip(source, tmp_path)
    back = tmp_path / "back"
    assert config["model_type"] == "deepseek_v3" and config["first_k_dense_replace"] == 1
    assert H.hf_logits(str(back), ids).sub(theirs).abs().max() == 0


def _train(config):
    import signal

    from swift_mcore.training.trainer import Trainer

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return Trainer(config).train()
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def test_sft_trains_exports_and_resumes_the_expert_bias_exactly(tmp_path, gloo_group):
    """`sft --model FOLDER` in this process: the LM loss falls, the routers' expert bias moves
    (aux-loss-free balancing), the checkpoint exports to a folder whose transformers logits
    are ours, and a run resumed from iteration 2 repeats the losses and ends with the same
    expert bias bit for bit."""
    from transformers import AutoModelForCausalLM

    from swift_mcore.arguments import SftArguments, parse_args
    from swift_mcore.loaded_model import forward_logits, load_model
    from swift_mcore.run_config import resolve
    from test_hf_training import run_flags
    from test_moe_training import write_chat
    from run_helpers import losses

    source = tmp_path / "hf"
    make_deepseek(source)
    data = tmp_path / "chat.jsonl"
    write_chat(data, 32)
    out, again = tmp_path / "sft", tmp_path / "again"
    flags = [*run_flags(), "--model", str(source), "--dataset", str(data), "--template",
             "plain", "--seq_length", "64", "--train_iters", "4", "--lr", "1e-2",
             "--min_lr", "1e-2", "--moe_router_bias_update_rate", "0.01",
             # DeepSeek-V3's own balancing beside the bias: the sequence-wise aux loss
             "--moe_router_load_balancing_type", "seq_aux_loss", "--moe_aux_loss_coeff", "1e-3"]
    config = resolve(parse_args([*flags, "--save_steps", "2", "--output_dir", str(out)],
                                cls=SftArguments), world_size=1)
    assert config.model.moe_router_enable_expert_bias and config.model.multi_latent_attention
    assert _train(config).iteration == 4
    ref = losses(out)
    assert ref[4] < ref[1], ref

    back = tmp_path / "back"
    convert(out / "checkpoint", back, "to_hf")
    hf = AutoModelForCausalLM.from_pretrained(str(back), attn_implementation="eager").eval()
    assert hf.config.model_type == "deepseek_v3"
    written = json.loads((back / "config.json").read_text())
    assert (written["seq_aux"], written["aux_loss_alpha"]) == (True, 1e-3)
    ids = H.tokens()
    loaded = load_model(str(out / "checkpoint"), log=lambda line: None)
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (forward_logits(loaded.model, ids)[..., : loaded.vocab] - theirs).abs().max() <= 1e-4
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    trained, initial = H.safetensors_state(str(back)), H.safetensors_state(str(source))
    assert not torch.equal(trained[bias], initial[bias])  # the balancing moved it

    resumed = resolve(parse_args([*flags, "--save_steps", "4", "--output_dir", str(again),
                                  "--resume", str(out / "checkpoint" / "iter_0000002")],
                                 cls=SftArguments), world_size=1)
    assert _train(resumed).iteration == 4
    got = losses(again)
    assert sorted(got) == [3, 4] and all(got[i] == ref[i] for i in got), (got, ref)
    convert(again / "checkpoint", tmp_path / "back2", "to_hf")
    repeated = H.safetensors_state(str(tmp_path / "back2"))
    for name in (bias, "model.layers.2.mlp.gate.e_score_correction_bias"):
        assert torch.equal(repeated[name], trained[name]), name


def test_infer_gives_transformers_greedy_tokens(tmp_path, gloo_group, capsys):
    make_deepseek(tmp_path / "hf")
    H.check_infer_is_greedy(tmp_path / "hf", capsys)


def test_what_megatron_cannot_express_is_named(tmp_path):
    """Each config.json value megatron cannot compute as transformers does is refused by its
    key before anything is built; so are MLA flags this version does not support."""
    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve

    folder = tmp_path / "ds"
    make_deepseek(folder)

    def refused(match, world_size=1, **flags):
        with pytest.raises(ArgumentError, match=match):
            resolve(RunArguments.from_flags(model=str(folder), **flags), world_size=world_size)

    cases = [
        (dict(topk_group=2), "num_experts_per_tok 2 with topk_group 2"),
        (dict(rope_interleave=False), "rope_interleave false"),
        (dict(norm_topk_prob=False), "norm_topk_prob false"),
        (dict(scoring_func="softmax"), "scoring_func 'softmax'"),
        (dict(num_key_value_heads=2), "num_key_value_heads 2"),
        (dict(rope_parameters={**YARN, "mscale": 0}), "mscale_all_dim 0.707 without mscale"),
        (dict(rope_parameters={**YARN, "truncate": False}), "truncate false"),
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
         "rope_type 'dynamic'"),
        (dict(n_group=3), "n_group 3 does not divide n_routed_experts 8"),
        (dict(rope_parameters={**YARN, "factor": "abc"}),
         r"rope_parameters\.factor 'abc' \(a number, above 0\)"),
        (dict(rope_parameters={**YARN, "factor": 0}), r"rope_parameters\.factor 0 \(a number, "
                                                      r"above 0\)"),
        (dict(rope_parameters={**YARN, "mscale": True}), r"rope_parameters\.mscale True"),
        (dict(rope_parameters=[1, 2]), r"rope_parameters \[1, 2\] \(an object\)"),
        (dict(attention_bias=True), "attention_bias True"),
        (dict(head_dim=24), r"head_dim 24 \(the rotary part of a head: only "
                            r"qk_rope_head_dim 8"),
    ]
    original = json.loads((folder / "config.json").read_text())
    for change, match in cases:
        (folder / "config.json").write_text(json.dumps({**original, **change}))
        refused(match)
    (folder / "config.json").write_text(json.dumps({**original, "first_k_dense_replace": 3}))
    refused(r"first_k_dense_replace 3 \(every layer dense\) with --mtp_num_layers 1: a "
            r"deepseek_v3 MTP layer is a mixture of experts", mtp_num_layers=1)
    (folder / "config.json").write_text(json.dumps({**original, "kv_lora_rank": 34}))
    refused(r"--tensor_model_parallel_size 4 must divide --kv_lora_rank \+ "
            r"--qk_pos_emb_head_dim \(42\)", world_size=4, tensor_model_parallel_size=4,
            sequence_parallel=True, global_batch_size=8)
    (folder / "config.json").write_text(json.dumps(original))
    with pytest.raises(ArgumentError, match="--multi_latent_attention with "
                       "--tensor_model_parallel_size 2 on Transformer Engine's layer spec"):
        resolve(RunArguments.from_flags(model=str(folder), tensor_model_parallel_size=2,
                                        sequence_parallel=True, global_batch_size=8),
                world_size=2, cuda=True, transformer_engine=True)  # a GPU, simulated
    refused("--multi_latent_attention with --attention_backend local",
            attention_backend="local")
    with pytest.raises(ArgumentError, match="--rope_type yarn is multi-latent attention's"):
        resolve(RunArguments.from_flags(rope_type="yarn"), world_size=1)
    with pytest.raises(ArgumentError, match="--moe_router_num_groups and --moe_router_group"):
        resolve(RunArguments.from_flags(num_experts=4, moe_router_num_groups=2), world_size=1)


def test_a_bfloat16_folder_keeps_its_float32_expert_bias(tmp_path, gloo_group):
    """The Hub's DeepSeek-V3 and GLM-4.5 files hold e_score_correction_bias in float32
    beside bfloat16 weights (transformers keeps it so): HF -> mcore -> HF gives every tensor
    back bit for bit, in its own dtype."""
    from safetensors.torch import save_file

    source = tmp_path / "hf"
    make_deepseek(source, num_hidden_layers=2)
    state = {name: tensor if name.endswith("e_score_correction_bias") else tensor.bfloat16()
             for name, tensor in H.safetensors_state(str(source)).items()}
    save_file(state, str(source / "model.safetensors"), metadata={"format": "pt"})
    H.edit_config(str(source), torch_dtype="bfloat16", dtype="bfloat16")
    convert(source, tmp_path / "mcore", "to_mcore")
    convert(tmp_path / "mcore", tmp_path / "back", "to_hf")
    exported = H.safetensors_state(str(tmp_path / "back"))
    assert sorted(exported) == sorted(state)
    for name, tensor in state.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def test_a_kimi_k2_folder_is_deepseek_v3(tmp_path, gloo_group):
    """model_type kimi_k2 (Kimi-K2's folders; transformers knows the architecture only as
    deepseek_v3) loads as DeepSeek-V3: the same logits, and exports as deepseek_v3 with the
    same tensors."""
    import shutil

    from swift_mcore.loaded_model import forward_logits, load_model

    source, kimi = tmp_path / "hf", tmp_path / "kimi"
    make_deepseek(source, num_hidden_layers=2)
    shutil.copytree(source, kimi)
    H.edit_config(str(kimi), model_type="kimi_k2")
    ids = H.tokens()
    loaded = load_model(str(kimi), log=lambda line: None)
    assert loaded.config.model.model_type == "deepseek_v3"
    ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    assert (ours - H.hf_logits(str(source), ids)).abs().max() <= 1e-4
    convert(kimi, tmp_path / "mcore", "to_mcore")
    convert(tmp_path / "mcore", tmp_path / "back", "to_hf")
    original, exported = H.safetensors_state(str(kimi)), H.safetensors_state(str(tmp_path / "back"))
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[name], tensor) for name, tensor in original.items())
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == \
        "deepseek_v3"


def test_a_folder_with_mtp_layers_is_refused_not_dropped(tmp_path, gloo_group):
    """The Hub's DeepSeek-V3 carries its multi-token-prediction layer as layer
    num_hidden_layers (tests/models/test_mtp_hf.py loads whole ones); a folder holding only
    part of one is refused, naming the tensors it lacks, instead of dropping what it has."""
    from safetensors.torch import load_file, save_file

    from swift_mcore.loaded_model import load_model

    folder = tmp_path / "hf"
    make_deepseek(folder, num_hidden_layers=2)
    state = load_file(str(folder / "model.safetensors"))
    state["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ArgumentError, match="model.layers.2.enorm.weight: missing from the "
                                            "weights"):
        load_model(str(folder), log=lambda line: None)


@pytest.mark.slow
def test_lora_on_mla_and_experts_trains_merges_and_exports_to_peft(tmp_path, train_here):
    """LoRA on every linear (MLA's down and up projections, the output projection, each
    expert's and the shared experts' fc1/fc2) trains and its merged export gives our logits
    in transformers; --to_peft refuses it by name (peft would put the dense MLP's adapters on
    the experts); adapters on MLA's projections alone, named as transformers names them,
    export to peft, which loads them to our logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from swift_mcore.loaded_model import forward_logits, load_model
    from test_hf_training import run_flags
    from test_lora_moe import LORA

    source = tmp_path / "hf"
    make_deepseek(source)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(100)))
    tokens = H.tokens(vocab=300, length=32)
    base_logits = H.hf_logits(str(source), tokens)
    mla = ["--target_modules", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
           "o_proj"]
    for name, targets in (("all", []), ("mla", mla)):
        out = tmp_path / name
        # a peft adapter holds no router state: the expert bias stays the folder's
        train_here(out, "--model", source, "--dataset", data, "--train_iters", "2",
                   "--save_steps", "2", "--lr", "2e-2", *LORA, *targets,
                   "--moe_router_bias_update_rate", "0", command="pt", base=run_flags())
        checkpoint = out / "checkpoint" / "iter_0000002"
        model = load_model(str(checkpoint), log=lambda line: None).model
        adapted = {n.split(".lora_", 1)[0] for n, _ in model.named_parameters()
                   if ".lora_" in n}
        assert {f"decoder.layers.1.self_attention.{kind}" for kind in (
            "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
            "linear_kv_up_proj", "linear_proj")} <= adapted
        assert any(".local_experts." in n for n in adapted) == (name == "all")
        ours = forward_logits(model, tokens)[..., :320]
        assert (ours - base_logits).abs().max() > 1e-2  # the adapters trained
        merged = tmp_path / f"{name}-merged"
        convert(checkpoint, merged, "to_hf", merge_lora=True)
        assert (H.hf_logits(str(merged), tokens) - ours).abs().max() < 1e-4
    with pytest.raises(ArgumentError, match=r"--to_peft: model\.layers\.0\.mlp\.down_proj "
                                            r"has an adapter, and peft maps every module"):
        convert(tmp_path / "all" / "checkpoint" / "iter_0000002", tmp_path / "peft-all",
                "to_peft")
    adapter = tmp_path / "peft"
    convert(checkpoint, adapter, "to_peft")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["target_modules"] == ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                        "q_a_proj", "q_b_proj"]
    base = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32,
                                                attn_implementation="eager")
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(base, str(adapter)).eval()(tokens).logits
    assert (peft_logits - ours).abs().max() < 1e-4


def test_lora_targets_a_model_does_not_have_are_refused(tmp_path):
    """q/k/v on multi-latent attention (or MLA's names on a q/k/v model) would leave the
    attention without adapters: refused, naming the layers the model has."""
    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve

    make_deepseek(tmp_path / "ds", num_hidden_layers=2)
    with pytest.raises(ArgumentError, match="--target_modules: this model has no linear_qkv "
                                            "layer; its linear layers are linear_q_down_proj, "
                                            "linear_q_up_proj, linear_kv_down_proj"):
        resolve(RunArguments.from_flags(model=str(tmp_path / "ds"), tuner_type="lora",
                                        target_modules=["q_proj", "k_proj", "v_proj"]),
                world_size=1)
    with pytest.raises(ArgumentError, match="this model has no linear_kv_up_proj layer"):
        resolve(RunArguments.from_flags(num_layers=2, hidden_size=64, num_attention_heads=4,
                                        tuner_type="lora", target_modules=["kv_b_proj"]),
                world_size=1)


@pytest.mark.slow
def test_ep2_gives_the_ep1_losses(tmp_path, train_here):
    """Continued pretraining of a DeepSeek-V3 folder at EP=2 (each rank loads its experts and
    their correction biases; the expert bias is updated from both ranks' loads) gives the
    one-rank losses."""
    from run_helpers import losses
    from test_hf_training import continue_pretraining, run_flags

    source = tmp_path / "hf"
    make_deepseek(source)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(200)))
    one, two = tmp_path / "ep1", tmp_path / "ep2"
    rate = ("--moe_router_bias_update_rate", "0.05")
    train_here(one, "--model", source, "--dataset", data, "--no_save", "--train_iters", "3",
               *rate, command="pt", base=run_flags())
    continue_pretraining(source, data, two, "--no_save", "--train_iters", "3", *rate,
                         "--expert_model_parallel_size", "2", nproc=2)
    ref, got = losses(one), losses(two)
    assert sorted(got) == [1, 2, 3]
    for it in ref:
        assert abs(got[it] - ref[it]) < 1e-5, (it, got[it], ref[it])


@pytest.mark.benchmark
def test_tp2_gives_the_one_rank_logits_losses_and_export(tmp_path, train_here):
    """TP=2 with sequence parallelism: each rank holds half of every head-split projection
    and of MLA's down projections; the logits equal the one-rank model's, the exported
    TP=2 checkpoint is the one-rank export bit for bit, and training gives the one-rank
    losses (the latent norms' gradients summed over the sequence shards)."""
    from swift_mcore.loaded_model import forward_logits, load_model
    from run_helpers import losses
    from test_hf_parallel import run_two_ranks
    from test_hf_training import continue_pretraining, run_flags

    source = tmp_path / "hf"
    make_deepseek(source)
    ids, out = run_two_ranks(tmp_path, source, 2, 1, "--sequence_parallel")
    ours = torch.load(out / "logits.pt")
    loaded = load_model(str(source), log=lambda line: None)
    one = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    # the row-parallel sums add the ranks' halves in another order: float rounding only
    # (1.2e-5 at logits up to ~6 here), so 1e-5 of the logits' scale
    assert ours.shape == one.shape
    assert (ours - one).abs().max() <= 1e-5 * one.abs().max()
    assert (ours - H.hf_logits(str(source), ids)).abs().max() <= 1e-4
    convert(source, tmp_path / "mcore", "to_mcore")
    convert(tmp_path / "mcore", tmp_path / "one", "to_hf")
    convert(out, tmp_path / "two", "to_hf")
    reference = H.safetensors_state(str(tmp_path / "one"))
    exported = H.safetensors_state(str(tmp_path / "two"))
    assert sorted(exported) == sorted(reference)
    for name, tensor in reference.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(200)))
    rate = ("--moe_router_bias_update_rate", "0.05", "--lr", "1e-2", "--min_lr", "1e-2")
    train_here(tmp_path / "tp1", "--model", source, "--dataset", data, "--no_save",
               "--train_iters", "3", *rate, command="pt", base=run_flags())
    continue_pretraining(source, data, tmp_path / "tp2", "--no_save", "--train_iters", "3",
                         *rate, "--tensor_model_parallel_size", "2", "--sequence_parallel",
                         nproc=2)
    ref, got = losses(tmp_path / "tp1"), losses(tmp_path / "tp2")
    assert sorted(got) == [1, 2, 3] and ref[3] < ref[1]
    for it in ref:
        assert abs(got[it] - ref[it]) < 1e-5, (it, got[it], ref[it])


@pytest.mark.benchmark
@pytest.mark.parametrize("tuner", [[], ["--tuner_type", "lora", "--lora_dropout", "0"]],
                         ids=["full", "lora"])
def test_dense_mla_at_tp2_without_sequence_parallelism_gives_the_one_rank_losses(tmp_path,
                                                                                 tuner):
    """Without --sequence_parallel every TP rank holds the whole shared RoPE key: its
    gradient, which each rank's heads give a part of, is summed over the ranks too (also
    through the LoRA layers on MLA's projections)."""
    from run_helpers import losses, run_pt, train_records

    flags = ["--num_query_groups", "4", "--multi_latent_attention", "--qk_layernorm",
             "--q_lora_rank", "24", "--kv_lora_rank", "16", "--qk_head_dim", "8",
             "--qk_pos_emb_head_dim", "4", "--v_head_dim", "8", "--lr", "1e-2",
             "--min_lr", "1e-2", "--train_iters", "3", "--no_save", *tuner]
    run_pt(tmp_path / "tp1", *flags)
    run_pt(tmp_path / "tp2", *flags, "--tensor_model_parallel_size", "2", nproc=2)
    ref, got = losses(tmp_path / "tp1"), losses(tmp_path / "tp2")
    assert sorted(got) == [1, 2, 3] and ref[3] < ref[1]
    for it in ref:
        assert abs(got[it] - ref[it]) < 1e-5, (it, got[it], ref[it])
    norms = [{r["iteration"]: r["grad_norm"] for r in train_records(tmp_path / run)}
             for run in ("tp1", "tp2")]
    assert all(abs(norms[1][it] - norms[0][it]) < 1e-4 for it in norms[0]), norms


def test_a_model_no_family_expresses_is_not_exported_as_another(tmp_path, gloo_group):
    """Flags from scratch: MLA or a sigmoid router cannot be written as a Llama or Qwen
    folder (which would compute something else); as deepseek_v3 they can."""
    from swift_mcore.arguments import RunArguments
    from swift_mcore.models.families import for_model_args
    from swift_mcore.run_config import resolve

    shape = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                 vocab_size=300)
    mla = dict(multi_latent_attention=True, qk_layernorm=True, kv_lora_rank=16,
               qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
    sigmoid = dict(num_experts=4, moe_router_score_function="sigmoid",
                   moe_router_enable_expert_bias=True, moe_layer_freq="[0,1]")
    for flags, match in [(dict(mla, model_type="llama", qk_layernorm=False),
                          "--multi_latent_attention True"),
                         (dict(num_experts=4, moe_router_score_function="sigmoid",
                               model_type="qwen3_moe"),
                          "--moe_router_score_function 'sigmoid'")]:
        m = resolve(RunArguments.from_flags(**shape, **flags), world_size=1).model
        with pytest.raises(ArgumentError, match=match):
            for_model_args(m)
    m = resolve(RunArguments.from_flags(**shape, **mla, **sigmoid), world_size=1).model
    assert for_model_args(m).name == "deepseek_v3"


@pytest.mark.benchmark
def test_cp2_gives_the_one_rank_losses_and_gradient_norms(tmp_path):
    """--context_parallel_size 2 on the DeepSeek-V3 folder (MLA with YaRN: the shared RoPE
    key and the queries' rope part rotated by each rank's chunks of YaRN's table, the CPU
    attention over the gathered keys with MLA's head sizes; routed experts with the
    expert-bias update): the one-rank losses and gradient norms within 1e-5."""
    from run_helpers import train_records
    from test_hf_training import continue_pretraining

    source = tmp_path / "hf"
    make_deepseek(source)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(200)))
    flags = ("--moe_router_bias_update_rate", "0.05", "--hidden_dropout", "0",
             "--attention_dropout", "0", "--no_save", "--train_iters", "3")
    continue_pretraining(source, data, tmp_path / "one", *flags)
    stdout = continue_pretraining(source, data, tmp_path / "cp2", *flags,
                                  "--context_parallel_size", "2", nproc=2)
    assert "CP 2" in stdout
    ref, got = train_records(tmp_path / "one"), train_records(tmp_path / "cp2")
    assert [r["iteration"] for r in got] == [1, 2, 3] and ref[2]["loss"] < ref[0]["loss"]
    for r, g in zip(ref, got):
        for key in ("loss", "grad_norm"):
            assert abs(g[key] - r[key]) <= 1e-5, (r["iteration"], key, g[key], r[key])


@pytest.mark.benchmark
def test_packed_sft_at_cp2_gives_the_one_rank_losses_and_gradient_norms(tmp_path):
    """Packed sft rows at CP=2 on the DeepSeek-V3 folder: the block-causal mask's query
    rows cut like the tokens, MLA's keys gathered, and the expert-bias update on: CP pads
    each row to a multiple of 2 x CP positions, which the routers leave out of their counts
    (training/moe_padding.py)."""
    from run_helpers import train_records
    from test_hf_training import train_from_hf
    from test_moe_training import write_chat

    source = tmp_path / "hf"
    make_deepseek(source)
    data = tmp_path / "chat.jsonl"
    write_chat(data, 32, varied=True)
    flags = ["--template", "plain", "--seq_length", "64", "--packing", "--train_iters", "3",
             "--no_save", "--hidden_dropout", "0", "--attention_dropout", "0",
             "--moe_router_bias_update_rate", "0.05"]
    train_from_hf("sft", source, data, tmp_path / "one", *flags, timeout=600)
    train_from_hf("sft", source, data, tmp_path / "cp2", *flags, "--context_parallel_size", "2",
                  nproc=2, timeout=600)
    ref, got = train_records(tmp_path / "one"), train_records(tmp_path / "cp2")
    assert [r["iteration"] for r in got] == [1, 2, 3]
    for r, g in zip(ref, got):
        for key in ("loss", "grad_norm"):
            assert abs(g[key] - r[key]) <= 1e-5, (r["iteration"], key, g[key], r[key])
