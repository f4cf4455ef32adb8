"""DeepSeek-V3, GLM-4.5 and gpt-oss over several ranks: at PP=2 a folder with its MTP layer
(the dense first layer on the first stage; the MoE layers and the MTP layer on the last)
loads to transformers' logits, exports bit for bit as the one-rank checkpoint does and trains
to the one-rank losses; runs stopped at TP=2 resume bit for bit, the routers' expert bias
(aux-loss-free balancing state) included; DeepSeek-V3 at TP=2 x EP=2 on four ranks trains
to the one-rank losses."""

import json

import pytest
import torch

import hf_helpers as H
from test_mtp_hf import MAKERS, add_mtp_layer


def write_data(path):
    path.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(200)))
    return path


@pytest.fixture(scope="module", params=sorted(MAKERS))
def mtp_folder(request, tmp_path_factory):
    """A 3-layer folder of the family (layer 0 dense) with one MTP layer (model.layers.3.*)."""
    tmp = tmp_path_factory.mktemp(request.param)
    source = tmp / "hf"
    MAKERS[request.param](source)
    add_mtp_layer(source, request.param, tmp)
    return request.param, source


PP2 = ("--pipeline_model_parallel_size", "2", "--decoder_first_pipeline_num_layers", "1")


@pytest.mark.benchmark
def test_pp2_loads_exports_and_trains_as_one_rank(mtp_folder, tmp_path, train_here):
    """PP=2, the first stage holding the dense layer and the last the two MoE layers and the
    MTP layer: transformers' logits; the checkpoint exports the one-rank export bit for bit
    (the MTP layer's tensors included); three training steps give the one-rank LM and MTP
    losses within 1e-5."""
    from run_helpers import train_records
    from test_hf_parallel import run_two_ranks
    from test_hf_training import continue_pretraining, run_flags

    family, source = mtp_folder
    ids, out = run_two_ranks(tmp_path, source, 1, 2, "--mtp_num_layers", "1",
                             "--first_stage_layers", "1")
    ours = torch.load(out / "logits.pt")
    theirs = H.hf_logits(str(source), ids)
    assert ours.shape == theirs.shape and (ours - theirs).abs().max() <= 1e-4
    H.convert(source, tmp_path / "mcore", "to_mcore")
    H.convert(tmp_path / "mcore", tmp_path / "one", "to_hf")
    H.convert(out, tmp_path / "two", "to_hf")
    reference = H.safetensors_state(str(tmp_path / "one"))
    exported = H.safetensors_state(str(tmp_path / "two"))
    assert sorted(exported) == sorted(reference) and "model.layers.3.eh_proj.weight" in exported
    for name, tensor in reference.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name

    data = write_data(tmp_path / "data.jsonl")
    flags = ("--no_save", "--train_iters", "3", "--mtp_num_layers", "1", "--lr", "1e-2",
             "--min_lr", "1e-2", "--moe_router_bias_update_rate", "0.05")
    train_here(tmp_path / "pp1", "--model", source, "--dataset", data, *flags, command="pt",
               base=run_flags())
    continue_pretraining(source, data, tmp_path / "pp2", *flags, *PP2, nproc=2)
    ref, got = train_records(tmp_path / "pp1"), train_records(tmp_path / "pp2")
    assert [r["iteration"] for r in got] == [1, 2, 3] and ref[2]["loss"] < ref[0]["loss"]
    for a, b in zip(ref, got):
        for key in ("loss", "mtp_loss"):
            assert abs(a[key] - b[key]) < 1e-5, (family, key, a, b)


def make_folder(family, tmp_path):
    """DeepSeek-V3 with its MTP layer (sigmoid routers with an expert bias), or gpt-oss."""
    from test_gpt_oss import make_gpt_oss

    source = tmp_path / "hf"
    if family == "gpt_oss":
        make_gpt_oss(source)
    else:
        MAKERS[family](source)
        add_mtp_layer(source, family, tmp_path)
    return source


# TP=2 with sequence parallelism; gpt-oss's biased experts stay whole on each rank
TP2 = {"deepseek_v3": ("--tensor_model_parallel_size", "2", "--sequence_parallel",
                       "--mtp_num_layers", "1", "--moe_router_bias_update_rate", "0.05"),
       "gpt_oss": ("--tensor_model_parallel_size", "2", "--sequence_parallel",
                   "--expert_tensor_parallel_size", "1")}


# gpt-oss's in the suite: it guards the experts' grad norm (training/optimizer.py)
@pytest.mark.parametrize("family", [pytest.param("deepseek_v3", marks=pytest.mark.benchmark),
                                    pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_a_run_stopped_at_tp2_resumes_bit_for_bit(family, tmp_path, train_here):
    """Four steps at TP=2 saving at step 2, then a run resumed from step 2: steps 3 and 4
    repeat the losses exactly (the MTP loss too), and both final checkpoints export the same
    folder bit for bit: every weight, and DeepSeek-V3's e_score_correction_bias, which the
    balancing moved and which the resumed run restored instead of starting over."""
    from run_helpers import losses, train_records
    from test_hf_training import continue_pretraining

    source = make_folder(family, tmp_path)
    data = write_data(tmp_path / "data.jsonl")
    flags = ("--train_iters", "4", "--lr", "1e-2", "--min_lr", "1e-2", *TP2[family])
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    continue_pretraining(source, data, straight, *flags, "--save_steps", "2", nproc=2)
    continue_pretraining(source, data, resumed, *flags, "--save_steps", "4", "--resume",
                         straight / "checkpoint" / "iter_0000002", nproc=2)
    ref, got = losses(straight), losses(resumed)
    assert sorted(got) == [3, 4] and ref[4] < ref[1]
    assert all(got[it] == ref[it] for it in got), (got, ref)
    if family == "gpt_oss":  # the first step's gradients are the one-rank ones, biases too
        from test_hf_training import run_flags

        train_here(tmp_path / "one", "--model", source, "--dataset", data, "--no_save",
                   "--lr", "1e-2", "--min_lr", "1e-2", "--train_iters", "1", command="pt",
                   base=run_flags())
        norms = [train_records(run)[0]["grad_norm"] for run in (tmp_path / "one", straight)]
        assert abs(norms[1] - norms[0]) <= 1e-5 * norms[0], norms
    if family == "deepseek_v3":
        records = {r["iteration"]: r["mtp_loss"] for r in train_records(straight)}
        assert all(r["mtp_loss"] == records[r["iteration"]] for r in train_records(resumed))
    for run in (straight, resumed):
        H.convert(run / "checkpoint", run / "hf", "to_hf")
    first, second = H.safetensors_state(str(straight / "hf")), H.safetensors_state(
        str(resumed / "hf"))
    initial = H.safetensors_state(str(source))
    assert sorted(first) == sorted(second) == sorted(initial)
    for name, tensor in first.items():
        assert torch.equal(second[name], tensor), name
    if family == "deepseek_v3":
        bias = "model.layers.1.mlp.gate.e_score_correction_bias"
        assert not torch.equal(first[bias], initial[bias])  # the balancing moved it


@pytest.mark.benchmark
def test_ep2_by_tp2_on_four_ranks_gives_the_one_rank_losses(tmp_path, train_here):
    """DeepSeek-V3 on four ranks, TP=2 with sequence parallelism times EP=2 (each rank holds
    half of four experts and the correction bias of all eight, updated from every rank's
    loads): the one-rank losses within 1e-5."""
    from run_helpers import losses
    from test_deepseek_v3 import make_deepseek
    from test_hf_training import continue_pretraining, run_flags

    source = tmp_path / "hf"
    make_deepseek(source)
    data = write_data(tmp_path / "data.jsonl")
    flags = ("--no_save", "--train_iters", "3", "--lr", "1e-2", "--min_lr", "1e-2",
             "--moe_router_bias_update_rate", "0.05")
    train_here(tmp_path / "one", "--model", source, "--dataset", data, *flags, command="pt",
               base=run_flags())
    continue_pretraining(source, data, tmp_path / "four", *flags,
                         "--tensor_model_parallel_size", "2", "--sequence_parallel",
                         "--expert_model_parallel_size", "2", nproc=4)
    ref, got = losses(tmp_path / "one"), losses(tmp_path / "four")
    assert sorted(got) == [1, 2, 3] and ref[3] < ref[1]
    for it in ref:
        assert abs(got[it] - ref[it]) < 1e-5, (it, got[it], ref[it])
