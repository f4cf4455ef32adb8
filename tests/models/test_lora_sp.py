"""LoRA under --sequence_parallel at TP=2: the adapters of a column- and a row-parallel
linear, fed a slice of the sequence, give the whole computation's output and gradients
once megatron has summed the marked gradients over the TP ranks; as decoder linears and as
a routed expert's (tokens gathered by the dispatcher)."""

import json
import subprocess
import sys

import pytest

import lora_sp_helpers as S


@pytest.mark.slow
def test_adapters_on_a_sequence_slice_give_the_whole_computation(tmp_path):
    from run_helpers import child_env, free_port

    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, S.__file__, str(tmp_path)],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(result) == ["decoder", "expert"]
        for case, differences in result.items():
            worst = max(differences, key=differences.get)
            assert differences[worst] < 1e-5, (rank, case, differences)
