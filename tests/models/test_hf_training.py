"""Continue pretraining from a Hugging Face folder, get a Hugging Face folder back
(--save_safetensors) that transformers loads, and generate from it with `infer`."""

import json
import subprocess
import sys

import pytest
import torch

import hf_helpers as H
from run_helpers import ROOT, TINY, child_env, losses, train_records

def run_flags():
    """run_helpers.TINY without its shape flags, which would contradict config.json."""
    shape = {"--num_layers", "--hidden_size", "--num_attention_heads", "--num_query_groups"}
    out = []
    for name, value in zip(TINY[0::2], TINY[1::2]):
        if name not in shape:
            out += [name, value]
    return out


def train_from_hf(command, source, data, out, *flags, nproc=1, timeout=240):
    """`swift-mcore COMMAND --model SOURCE --dataset DATA` (4 iterations unless ``flags``
    say otherwise) in a child process, on ``nproc`` ranks; its stdout."""
    cmd = [sys.executable, "-m", "swift_mcore", command, *run_flags(), "--model", str(source),
           "--dataset", str(data), "--train_iters", "4", "--output_dir", str(out), *flags]
    env = child_env()
    if nproc > 1:
        env.update(NPROC_PER_NODE=str(nproc), MASTER_PORT=str(H.free_port()))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def continue_pretraining(source, data, out, *flags, nproc=1):
    return train_from_hf("pt", source, data, out, *flags, nproc=nproc)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, train_here):
    """continue_pretraining in this process (the run, not its process, is what the tests
    read)."""
    root = tmp_path_factory.mktemp("continue")
    source = root / "hf"
    H.make_family(str(source), "qwen2", tie_word_embeddings=False)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def add(a, b):\n    return a + b  # {i}\n"})
                            + "\n" for i in range(200)))
    out = root / "run"
    stdout = train_here(out, "--model", source, "--dataset", data, "--train_iters", "4",
                        "--save_safetensors", command="pt", base=run_flags()).stdout
    return source, out, stdout, data


@pytest.mark.slow
def test_continue_pretraining_exports_a_folder_transformers_loads(trained, gloo_group):
    from transformers import AutoModelForCausalLM

    from swift_mcore.loaded_model import forward_logits, load_model

    source, out, stdout, _ = trained
    assert "loaded Hugging Face weights from" in stdout
    curve = losses(out)
    assert sorted(curve) == [1, 2, 3, 4] and curve[4] < curve[1]
    folder = out / "checkpoint" / "iter_0000004-hf"
    assert f"--save_safetensors: wrote {folder}" in stdout
    saved_args = json.loads((out / "checkpoint" / "iter_0000004" / "args.json").read_text())
    assert saved_args["model"]["model_type"] == "qwen2"

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    original = H.safetensors_state(str(source))
    trained_state = H.safetensors_state(str(folder))
    assert sorted(trained_state) == sorted(original)
    assert not torch.equal(trained_state["model.embed_tokens.weight"],
                           original["model.embed_tokens.weight"])  # training changed it
    ids = H.tokens(length=32)
    checkpoint = load_model(str(out), log=lambda line: None)
    ours = forward_logits(checkpoint.model, ids)[..., : checkpoint.vocab]
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (ours - theirs).abs().max() <= 1e-4


@pytest.mark.slow
def test_infer_greedy_matches_transformers_generate(trained, gloo_group, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swift_mcore.arguments.infer import InferArguments
    from swift_mcore.infer import run

    _, out, _, _ = trained
    folder = out / "checkpoint" / "iter_0000004-hf"
    text = run(InferArguments(model=str(out), prompt="def add(", max_new_tokens=8).validate())
    assert capsys.readouterr().out.startswith("def add(")

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    prompt = tokenizer("def add(", return_tensors="pt").input_ids
    generated = hf.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                            pad_token_id=tokenizer.eos_token_id)
    expected = tokenizer.decode(generated[0, prompt.shape[1]:])
    assert expected.startswith(text) and text  # ours stops early only at end-of-document

    sampled = run(InferArguments(model=str(folder), prompt="def add(", max_new_tokens=8,
                                 temperature=1.0, top_p=0.9, seed=1).validate())
    again = run(InferArguments(model=str(folder), prompt="def add(", max_new_tokens=8,
                               temperature=1.0, top_p=0.9, seed=1).validate())
    assert sampled == again  # the seed decides the sample


@pytest.mark.slow
def test_tensor_parallel_training_from_hf_matches_one_rank(trained, tmp_path):
    """Sharded at load, the same losses and gradient norms as one rank: the shards carry
    megatron's tensor-parallel marks (the gradient norm counts every shard)."""
    source, out, _, data = trained
    tp2 = tmp_path / "tp2"
    continue_pretraining(source, data, tp2, "--no_save", "--tensor_model_parallel_size", "2",
                         nproc=2)
    one = {r["iteration"]: r for r in train_records(out)}
    two = {r["iteration"]: r for r in train_records(tp2)}
    assert sorted(two) == sorted(one) == [1, 2, 3, 4]
    for it in one:
        assert abs(two[it]["loss"] - one[it]["loss"]) <= 1e-5, it
        assert abs(two[it]["grad_norm"] - one[it]["grad_norm"]) <= 1e-4 * one[it]["grad_norm"], it
