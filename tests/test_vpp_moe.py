"""The interleaved pipeline with mixture-of-experts models (PP=2 x 2 virtual stages on 2
gloo ranks): a Qwen3-MoE-style model (softmax top-k, load-balancing and z-loss) and a
DeepSeek-V3-style one (sigmoid routing with the expert bias, a dense first layer, a shared
expert, a MoE MTP layer) give the one-rank LM loss, router losses as logged and gradient
norms, keep the expert bias of every chunk as one rank does, resume bit for bit, and
continue at PP=1."""

import os

import pytest

from run_helpers import checkpoint_tensors, run_pt, train_records
from swift_mcore.arguments import RunArguments
from swift_mcore.run_config import resolve

# 4 layers: one per chunk (rank 0: layers 0 and 2, rank 1: layers 1 and 3, and the MTP
# layer on rank 1's last chunk); 4 micro-batches per iteration, two groups of PP
SHAPE = ["--num_layers", "4", "--train_iters", "4"]
VPP = ["--pipeline_model_parallel_size", "2", "--num_virtual_stages_per_pipeline_rank", "2"]
EXPERTS = ["--num_experts", "4", "--moe_router_topk", "2", "--moe_ffn_hidden_size", "32"]
FAMILIES = {
    "qwen3_moe": [*EXPERTS, "--moe_aux_loss_coeff", "0.1", "--moe_z_loss_coeff", "0.01"],
    # the bias moves 0.01 a step so that it changes the routing within these few steps
    "deepseek_v3": [*EXPERTS, "--moe_router_score_function", "sigmoid",
                    "--moe_router_enable_expert_bias", "--moe_router_bias_update_rate", "0.01",
                    "--moe_layer_freq", "[0,1,1,1]", "--moe_shared_expert_intermediate_size",
                    "32", "--moe_router_load_balancing_type", "seq_aux_loss",
                    "--moe_aux_loss_coeff", "0.01", "--moe_router_topk_scaling_factor", "2.5",
                    "--mtp_num_layers", "1"],
}
LOGGED = {"qwen3_moe": ("loss", "grad_norm", "load_balancing_loss", "z_loss"),
          "deepseek_v3": ("loss", "grad_norm", "seq_load_balancing_loss", "mtp_loss")}

# padded sft rows: one turn of 1 to 9 of these words a message
WORDS = "alpha beta gamma delta river stone cloud paper orange silver seven north".split()


def records(out):
    return {r["iteration"]: r for r in train_records(out)}


def expert_biases(folder, scratch):
    """Every router's expert bias in a checkpoint, by name."""
    return checkpoint_tensors(folder, scratch, lambda name, t: name.endswith("expert_bias"))


@pytest.mark.benchmark
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_interleaved_moe_gives_the_one_rank_run_and_resumes_exactly(family, tmp_path):
    moe = FAMILIES[family]
    one, vpp, again, pp1 = (tmp_path / name for name in ("one", "vpp", "again", "pp1"))
    run_pt(one, *SHAPE, *moe, "--save_steps", "1")
    run_pt(vpp, *SHAPE, *moe, *VPP, "--save_steps", "2",
           "--resume", one / "checkpoint" / "iter_0000001", nproc=2, timeout=600)
    ref, got = records(one), records(vpp)
    assert sorted(got) == [2, 3, 4]
    for it in got:
        for key in LOGGED[family]:
            assert abs(got[it][key] - ref[it][key]) <= 1e-5, (it, key, got[it][key],
                                                              ref[it][key])
    saved = vpp / "checkpoint" / "iter_0000002"
    run_pt(again, *SHAPE, *moe, *VPP, "--save_steps", "2", "--resume", saved, nproc=2,
           timeout=600)
    resumed = records(again)
    assert sorted(resumed) == [3, 4]
    for it in resumed:
        for key in LOGGED[family]:
            assert resumed[it][key] == got[it][key], (it, key)
    run_pt(pp1, *SHAPE, *moe, "--no_save", "--resume", saved)
    flat = records(pp1)
    assert sorted(flat) == [3, 4]
    for it in flat:
        for key in LOGGED[family]:
            assert abs(flat[it][key] - got[it][key]) <= 1e-5, (it, key)
    if family != "deepseek_v3":
        return
    # every MoE layer's bias, the MTP layer's included, updated in each of the chunks as on
    # one rank (megatron's finalize_model_grads over all chunks), saved and resumed exactly
    last = os.path.join("checkpoint", "iter_0000004")
    biases = {name: expert_biases(str(out / last), tmp_path)
              for name, out in (("one", one), ("vpp", vpp), ("again", again))}
    assert sorted(biases["one"]) == sorted(biases["vpp"]) == sorted(biases["again"]) == [
        "decoder.layers.1.mlp.router.expert_bias", "decoder.layers.2.mlp.router.expert_bias",
        "decoder.layers.3.mlp.router.expert_bias",
        "mtp.layers.0.transformer_layer.mlp.router.expert_bias"]
    for name, bias in biases["one"].items():
        assert bias.abs().sum() > 0, (name, bias)
        assert bias.tolist() == biases["vpp"][name].tolist() == biases["again"][name].tolist(
        ), (name, bias, biases["vpp"][name], biases["again"][name])


SMALL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, micro_batch_size=1,
             global_batch_size=4, pipeline_model_parallel_size=2,
             num_virtual_stages_per_pipeline_rank=2, num_experts=4, moe_ffn_hidden_size=32)


@pytest.mark.parametrize("flags", [{}, {"moe_layer_freq": "[0,1,1,1]", "mtp_num_layers": 1,
                                        "moe_router_score_function": "sigmoid",
                                        "moe_router_enable_expert_bias": True}])
def test_moe_models_take_the_interleaved_schedule(flags):
    config = resolve(RunArguments.from_flags(**SMALL, **flags), world_size=2, cuda=False)
    assert config.args.virtual_stages() == 2


@pytest.mark.benchmark
def test_interleaved_moe_with_expert_parallelism_on_four_ranks(tmp_path):
    """PP=2 x 2 virtual stages x EP=2 (DP=2, the experts of each layer split over the two
    data-parallel ranks of a stage) with the DeepSeek-V3-style model: the one-rank losses
    from the same weights, and its checkpoint resumes bit for bit, expert biases included."""
    moe = FAMILIES["deepseek_v3"]
    layout = [*VPP, "--expert_model_parallel_size", "2"]
    one, ep, again = tmp_path / "one", tmp_path / "ep", tmp_path / "again"
    run_pt(one, *SHAPE, *moe, "--save_steps", "1")
    proc = run_pt(ep, *SHAPE, *moe, *layout, "--save_steps", "2",
                  "--resume", one / "checkpoint" / "iter_0000001", nproc=4, timeout=900)
    assert "PP 2 x DP 2 (EP 2)" in proc.stdout
    ref, got = records(one), records(ep)
    assert sorted(got) == [2, 3, 4]
    for it in got:
        for key in LOGGED["deepseek_v3"]:
            assert abs(got[it][key] - ref[it][key]) <= 1e-5, (it, key, got[it][key],
                                                              ref[it][key])
    run_pt(again, *SHAPE, *moe, *layout, "--save_steps", "2",
           "--resume", ep / "checkpoint" / "iter_0000002", nproc=4, timeout=900)
    resumed = records(again)
    assert sorted(resumed) == [3, 4]
    assert all(resumed[it][key] == got[it][key] for it in resumed
               for key in LOGGED["deepseek_v3"]), (resumed, got)
    last = os.path.join("checkpoint", "iter_0000004")
    biases = [expert_biases(str(out / last), tmp_path) for out in (one, ep, again)]
    assert len(biases[0]) == 4 and all(b.abs().sum() > 0 for b in biases[0].values())
    for name, bias in biases[0].items():
        assert bias.tolist() == biases[1][name].tolist() == biases[2][name].tolist(), name


@pytest.mark.benchmark
def test_padded_sft_routes_as_one_rank_in_every_chunk(tmp_path):
    """sft rows padded to the longest of their micro-batch, with the padding left out of
    routing (training/moe_padding.py hands each chunk the batch's mask; the MTP layer on the
    last chunk rolls its own) and the expert-bias update moving the routing by the counts:
    PP=2 x 2 virtual stages gives, from a one-rank checkpoint, the one-rank LM, MTP,
    load-balancing and z-losses and gradient norms."""
    from run_helpers import one_turn_conversations, run_sft

    data = one_turn_conversations(tmp_path / "train.jsonl", WORDS)
    flags = [*EXPERTS, "--moe_router_score_function", "sigmoid",
             "--moe_router_enable_expert_bias", "--moe_router_bias_update_rate", "0.05",
             "--moe_aux_loss_coeff", "0.1", "--moe_z_loss_coeff", "0.01", "--dataset", data,
             "--template", "plain", "--seq_length", "64", "--train_iters", "3",
             "--global_batch_size", "4", "--hidden_dropout", "0", "--attention_dropout", "0",
             "--num_layers", "4", "--mtp_num_layers", "1"]
    one, vpp = tmp_path / "one", tmp_path / "vpp"
    run_sft(one, *flags, "--save_steps", "1")
    run_sft(vpp, *flags, *VPP, "--no_save", "--resume", one / "checkpoint" / "iter_0000001",
            nproc=2, timeout=600)
    ref, got = records(one), records(vpp)
    assert sorted(got) == [2, 3]
    for it in got:
        for key in ("loss", "mtp_loss", "load_balancing_loss", "z_loss", "grad_norm"):
            assert abs(got[it][key] - ref[it][key]) <= 1e-5, (it, key, got[it][key],
                                                              ref[it][key])


@pytest.mark.benchmark
def test_uneven_interleaved_moe_stages_give_the_one_rank_losses(tmp_path):
    """A 4-layer first stage of 6 layers in 2 virtual stages (rank 0: layers 0-1 and 3-4,
    rank 1: layers 2 and 5), the first layer dense: each chunk builds its own slice of
    --moe_layer_freq, and from a one-rank checkpoint the run gives the one-rank losses."""
    moe = [*EXPERTS, "--moe_router_score_function", "sigmoid",
           "--moe_router_enable_expert_bias", "--moe_router_bias_update_rate", "0.01",
           "--moe_layer_freq", "[0,1,1,1,1,1]", "--moe_aux_loss_coeff", "0.01",
           "--moe_z_loss_coeff", "0.01"]
    shape = ["--num_layers", "6", "--train_iters", "3"]
    one, vpp = tmp_path / "one", tmp_path / "vpp"
    run_pt(one, *shape, *moe, "--save_steps", "1")
    run_pt(vpp, *shape, *moe, *VPP, "--decoder_first_pipeline_num_layers", "4", "--no_save",
           "--resume", one / "checkpoint" / "iter_0000001", nproc=2, timeout=600)
    ref, got = records(one), records(vpp)
    assert sorted(got) == [2, 3]
    for it in got:
        for key in ("loss", "grad_norm", "load_balancing_loss", "z_loss"):
            assert abs(got[it][key] - ref[it][key]) <= 1e-5, (it, key)
