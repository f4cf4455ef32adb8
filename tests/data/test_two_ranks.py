"""World size 2 on gloo: rank 0 builds the index caches, rank 1 loads them, and the two
data-parallel ranks together read exactly what one rank reads alone."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from swift_mcore.data.gpt_datasets import build_datasets, dataset_fingerprint
from swift_mcore.data.loader import build_data_iterator

from data_helpers import make_args
from run_helpers import free_port

WORKER = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from swift_mcore.runtime.cpu import cpu_compat
    cpu_compat.activate()
    from megatron.core import parallel_state
    from swift_mcore.arguments import RunArguments
    from swift_mcore.data import build_tokenizer, build_datasets, build_data_iterator
    from swift_mcore.data import dataset_fingerprint
    from swift_mcore.run_config import resolve

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel()
    out_dir, data_path, n_batches = sys.argv[1], sys.argv[2:-1], int(sys.argv[-1])
    args = resolve(RunArguments.from_flags(
        data_path=data_path, seq_length=32, micro_batch_size=2, global_batch_size=8,
        num_workers=1, seed=1234, output_dir=out_dir), world_size=2)
    tokenizer = build_tokenizer(args)
    train, valid, test = build_datasets(args, tokenizer)
    it = build_data_iterator(train, 8, args, dp_rank=rank, dp_size=2)
    batches = [next(it) for _ in range(n_batches)]
    torch.save({"len": [len(train), len(valid)], "fingerprint": dataset_fingerprint(train),
                "tokens": torch.cat([b["tokens"] for b in batches]),
                "sample_ids": torch.cat([b["sample_ids"] for b in batches])},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # results are saved; skip interpreter teardown (see DESIGN.md on gloo aborts)
""")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_ranks_build_and_split_the_data(small_prefixes, tokenizer, tmp_path, gloo_group):
    data_path = ["1", small_prefixes["a"], "2", small_prefixes["b"]]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "PYTHONWARNINGS": "ignore"}
    n_batches = 6  # per rank: three iterations of GBS 8 = 2 ranks x 2 micro-batches x 2
    procs = [subprocess.Popen([sys.executable, str(script), str(out_dir), *data_path,
                               str(n_batches)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    logs = [p.communicate(timeout=200)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    ranks = [torch.load(out_dir / f"rank{r}.pt") for r in range(2)]

    # The same data as one process builds from the caches the two ranks left behind.
    args = make_args(tmp_path, data_path=data_path, output_dir=str(out_dir))
    train, valid, _ = build_datasets(args, tokenizer)
    assert ranks[0]["len"] == ranks[1]["len"] == [len(train), len(valid)]
    assert ranks[0]["fingerprint"] == ranks[1]["fingerprint"] == dataset_fingerprint(train)
    single = [next(it) for it in [build_data_iterator(train, 8, args)] for _ in range(12)]
    for i in range(3):  # iteration i: rank 0 holds the first half of the global batch
        expected = torch.cat([b["tokens"] for b in single[4 * i:4 * i + 4]])
        got = torch.cat([ranks[r]["tokens"][4 * i:4 * i + 4] for r in range(2)])
        assert torch.equal(got, expected)
        ids = torch.cat([ranks[r]["sample_ids"][4 * i:4 * i + 4] for r in range(2)])
        assert ids.tolist() == list(range(8 + 8 * i, 16 + 8 * i))
