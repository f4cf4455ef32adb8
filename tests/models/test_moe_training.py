"""Training from a Hugging Face MoE folder: continued pretraining at EP=2 (gloo, alltoall),
each rank loading its own experts' slices, gives the EP=1 losses; sft on Qwen3-MoE,
Qwen2-MoE and Mixtral folders trains, logs the load-balancing loss, and exports a folder
transformers loads."""

import json
import signal
import subprocess
import sys

import pytest
import torch

import hf_helpers as H
from run_helpers import ROOT, child_env, losses, train_records
from test_hf_training import continue_pretraining, run_flags
from test_moe_families import convert, make_moe



def write_chat(path, rows: int, varied: bool = False) -> None:
    """``rows`` one-turn chats that a few sft steps learn (the answer is always the same);
    ``varied``: questions of 0 to 6 repeats, rows of different lengths to pad or pack."""
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"add {i} " * (i % 7) if varied else f"add {i}"},
        {"role": "assistant", "content": "def add(a, b): return a + b"}]}) + "\n"
        for i in range(rows)))

def test_ep2_from_hf_folder_gives_the_ep1_losses(tmp_path, train_here):
    source = tmp_path / "hf"
    make_moe(source, "qwen2_moe")  # a dense first layer, the gated shared expert
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(200)))
    one, two = tmp_path / "ep1", tmp_path / "ep2"
    # EP=1 in this process: continue_pretraining's flags
    stdout = train_here(one, "--model", source, "--dataset", data, "--no_save",
                        "--train_iters", "3", command="pt", base=run_flags()).stdout
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
    write_chat(data, 64)
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


@pytest.mark.parametrize("family, balancing", [("qwen2_moe", "global_aux_loss"),
                                               ("mixtral", "seq_aux_loss"),
                                               ("qwen3_moe", "seq_aux_loss")])
def test_sft_on_moe_folders_with_each_balancing_loss(tmp_path, gloo_group, family, balancing):
    """`sft --model FOLDER` in this process (Trainer, as the command runs it): Qwen2-MoE with
    its dense first layer and gated shared expert, Mixtral and Qwen3-MoE; the load-balancing
    loss from config.json is logged, the LM loss falls, and the checkpoint exports to a
    folder whose transformers logits are ours. The load-balancing type is a training choice
    that export does not refuse (router_aux_loss_coef keeps the coefficient)."""
    from transformers import AutoModelForCausalLM

    from swift_mcore.arguments import SftArguments, parse_args
    from swift_mcore.loaded_model import forward_logits, load_model
    from swift_mcore.run_config import resolve
    from swift_mcore.training.trainer import Trainer

    source = tmp_path / "hf"
    make_moe(source, family)
    H.edit_config(str(source), router_aux_loss_coef=0.02)
    data = tmp_path / "chat.jsonl"
    write_chat(data, 32)
    out = tmp_path / "sft"
    argv = [*run_flags(), "--model", str(source), "--dataset", str(data), "--template",
            "plain", "--seq_length", "64", "--train_iters", "4", "--lr", "1e-2",
            "--min_lr", "1e-2", "--save_steps", "4", "--output_dir", str(out),
            "--moe_router_load_balancing_type", balancing]
    config = resolve(parse_args(argv, cls=SftArguments), world_size=1)
    assert config.model.moe_aux_loss_coeff == 0.02 and config.model.num_experts == 4
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert Trainer(config).train().iteration == 4
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    records = train_records(out)
    name = {"global_aux_loss": "global_load_balancing_loss",
            "seq_aux_loss": "seq_load_balancing_loss"}[balancing]
    assert len(records) == 4 and all(r[name] > 0.5 for r in records), records[0]
    assert records[-1]["loss"] < records[0]["loss"], [r["loss"] for r in records]

    back = tmp_path / "back"
    convert(out / "checkpoint", back, "to_hf")
    hf = AutoModelForCausalLM.from_pretrained(str(back), attn_implementation="eager").eval()
    assert hf.config.model_type == family and hf.config.router_aux_loss_coef == 0.02
    ids = H.tokens()
    loaded = load_model(str(out / "checkpoint"), log=lambda line: None)
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (forward_logits(loaded.model, ids)[..., : loaded.vocab] - theirs).abs().max() <= 1e-4
    assert not torch.equal(H.safetensors_state(str(back))["model.norm.weight"],
                           H.safetensors_state(str(source))["model.norm.weight"])


def test_sinkhorn_from_a_moe_folder_is_refused_before_training(tmp_path):
    """A load-balancing type the family's router cannot express (sinkhorn routes otherwise
    while training) is refused at resolve, naming the flag, not at export after training."""
    from swift_mcore.arguments import SftArguments, parse_args
    from swift_mcore.errors import ArgumentError
    from swift_mcore.run_config import resolve

    source = tmp_path / "hf"
    make_moe(source, "qwen3_moe")
    data = tmp_path / "chat.jsonl"
    write_chat(data, 4)
    argv = [*run_flags(), "--model", str(source), "--dataset", str(data), "--template",
            "plain", "--train_iters", "1", "--output_dir", str(tmp_path / "sft"),
            "--moe_router_load_balancing_type", "sinkhorn", "--moe_aux_loss_coeff", "0"]
    with pytest.raises(ArgumentError) as err:
        resolve(parse_args(argv, cls=SftArguments), world_size=1)
    assert str(err.value) == (
        f"--moe_router_load_balancing_type sinkhorn (a qwen3_moe router chooses its experts "
        f"by the top-k router logits): the model of --model {source} trained so could not be "
        f"exported as a qwen3_moe model; use aux_loss, seq_aux_loss or global_aux_loss")
    assert not (tmp_path / "sft").exists()
