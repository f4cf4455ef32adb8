"""A world of 2 on gloo (TP=2) for a test: a helper module's ``on_each_rank()`` run in two
processes, each rank's result (a JSON-able dict) read back."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List


def run_two_ranks(helper, out_dir, timeout: float, **env: str) -> List[dict]:
    """``on_each_rank()`` of the module at ``helper`` on ranks 0 and 1 (``env``: more
    environment for both): their results, rank 0's first. A rank that fails fails the test
    with the end of its log."""
    from run_helpers import child_env, free_port

    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
                    **env)
    procs = [subprocess.Popen([sys.executable, __file__, str(helper), str(out_dir)],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(2)]


def main(helper: str, out_dir: str) -> None:  # one rank (RANK in the environment)
    import torch.distributed as dist
    from megatron.core import parallel_state

    from swift_mcore.runtime.cpu import cpu_compat

    cpu_compat.activate()
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(2, 1)
    spec = importlib.util.spec_from_file_location(Path(helper).stem, helper)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.on_each_rank()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # results written; skip gloo's interpreter teardown (docs/cpu.md)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
