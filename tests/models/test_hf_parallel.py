"""TP=2 and PP=2 on gloo: a Hugging Face model sharded at load gives the HF logits, and its
checkpoint exports back to bit-identical safetensors."""

import os
import subprocess
import sys

import pytest
import torch

import hf_helpers as H

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_two_ranks(tmp_path, model, tp, pp, *extra, ids=None):
    ids = H.tokens(length=48) if ids is None else ids
    torch.save(ids, tmp_path / "tokens.pt")
    out = tmp_path / "run"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={H.free_port()}", WORKER, "--model", str(model), "--out", str(out),
           "--tp", str(tp), "--pp", str(pp), "--tokens", str(tmp_path / "tokens.pt"), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return ids, out


@pytest.mark.slow
@pytest.mark.parametrize("family, tp, pp, overrides", [
    # odd vocabulary: TP=2 pads the embedding by one row, the export drops it again
    ("qwen2", 2, 1, {"vocab_size": 321, "tie_word_embeddings": False}),
    # tied embeddings across stages: the last stage's output layer is the first's embedding
    ("qwen3", 1, 2, {"tie_word_embeddings": True}),
])
def test_sharded_load_matches_hf_and_exports_bit_identical(tmp_path, gloo_group, family, tp, pp,
                                                           overrides):
    from swift_mcore.export import run
    from swift_mcore.arguments.export import ExportArguments

    model = tmp_path / "hf"
    H.make_family(str(model), family, **overrides)
    ids, out = run_two_ranks(tmp_path, model, tp, pp)
    ours = torch.load(out / "logits.pt")
    theirs = H.hf_logits(str(model), ids)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() <= 1e-4

    exported = tmp_path / "exported"
    run(ExportArguments(model=str(out), output_dir=str(exported), to_hf=True).validate(),
        log=lambda line: None)
    original, back = H.safetensors_state(str(model)), H.safetensors_state(str(exported))
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
