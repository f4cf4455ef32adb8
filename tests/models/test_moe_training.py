"""Training from a Hugging Face MoE folder: continued pretraining at EP=2 (gloo, alltoall),
each rank loading its own experts' slices, gives the EP=1 losses; sft on a Qwen3-MoE folder
trains, logs the load-balancing loss, and exports a folder transformers loads."""

import json
import subprocess
import sys

import torch

import hf_helpers as H
from run_helpers import ROOT, child_env, losses, train_records
from test_hf_training import continue_pretraining, run_flags
from test_moe_families import convert, make_moe


def test_ep2_from_hf_folder_gives_the_ep1_losses(tmp_path):
    source = tmp_path / "hf"
    make_moe(source, "qwen2_moe")  # a dense first layer, the gated shared expert
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(200)))
    one, two = tmp_path / "ep1", tmp_path / "ep2"
    stdout = continue_pretraining(source, data, one, "--no_save", "--train_iters", "3")
    assert "loaded Hugging Face weights from" in stdout
    continue_pretraining(source, data, two, "--no_save", "--train_iters", "3",
                         "--expert_model_parallel_size", "2", nproc=2)
    ref, got = losses(one), losses(two)
    assert sorted(got) == [1, 2, 3]
    for it in ref:
        assert abs(got[it] - ref[it]) < 1e-5, (it, got[it], ref[it])


def test_sft_on_a_qwen3_moe_folder_trains_and_exports_to_transformers(tmp_path, gloo_group):
    from transformers import AutoModelForCausalLM

    from swift_mcore.loaded_model import forward_logits, load_model

    source = tmp_path / "hf"
    make_moe(source, "qwen3_moe")  # router_aux_loss_coef 0.001 from its config.json
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"add {i}"},
        {"role": "assistant", "content": "def add(a, b): return a + b"}]}) + "\n"
        for i in range(64)))
    out = tmp_path / "sft"
    cmd = [sys.executable, "-m", "swift_mcore", "sft", *run_flags(), "--model", str(source),
           "--dataset", str(data), "--template", "plain", "--seq_length", "64",
           "--train_iters", "10",
           "--lr", "1e-2", "--min_lr", "1e-2", "--save_steps", "10", "--output_dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = train_records(out)
    assert len(records) == 10 and "| load_balancing_loss " in proc.stdout
    assert all(r["load_balancing_loss"] > 0.5 for r in records)
    first, last = records[0]["loss"], records[-1]["loss"]
    assert last < 0.5 * first, [r["loss"] for r in records]

    back = tmp_path / "back"
    convert(out / "checkpoint", back, "to_hf")
    hf = AutoModelForCausalLM.from_pretrained(str(back), attn_implementation="eager").eval()
    ids = H.tokens()
    loaded = load_model(str(out / "checkpoint"), log=lambda line: None)
    with torch.no_grad():
        theirs = hf(ids).logits
    ours = forward_logits(loaded.model, ids)[..., : loaded.vocab]
    assert (ours - theirs).abs().max() <= 1e-4
    assert hf.config.model_type == "qwen3_moe" and hf.config.num_experts == 4
    assert not torch.equal(H.safetensors_state(str(back))["model.norm.weight"],
                           H.safetensors_state(str(source))["model.norm.weight"])
