"""Continue pretraining a Hugging Face MoE folder at EP=2 (gloo, alltoall): each rank loads
its own experts' slices, and the losses are EP=1's."""

import json

from run_helpers import losses
from test_hf_training import continue_pretraining
from test_moe_families import make_moe


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
