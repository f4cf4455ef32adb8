"""Optimizer-state bytes per rank with and without the distributed optimizer, at DP 1, 2 and 4.

For each data-parallel size and each optimizer (megatron's plain one, and its distributed
optimizer, ZeRO-1: ``--use_distributed_optimizer``), torchrun starts DP gloo ranks that build
the model (default: throughput.py's "10m"), DDP and the optimizer exactly as ``swift-mcore pt``
does, run one forward/backward/step (Adam's state exists after its first step), and sum the
bytes of every tensor in the torch optimizer's state (Adam's two moments; in float32 the
weights are the main copies themselves, so there is no separate fp32 copy). The distributed
optimizer is expected to hold 1/DP of the plain one's per rank, up to megatron's padding of
each bucket to a multiple of DP. Prints one JSON line per (DP, optimizer) and a last line
with the ratios ``distributed / plain`` per DP.

  python benchmarks/optimizer_memory.py                      # the 10m model, DP 1, 2, 4
  python benchmarks/optimizer_memory.py --tiny --dp 1 2      # smoke test
"""

import argparse
import json
import os
import subprocess
import sys

from bench_common import LLAMA_SETTINGS, ROOT, SHAPES  # puts the checkout on sys.path

VOCAB = 4096


def worker(size: str, distributed_optimizer: bool) -> None:
    """One rank: build, one step, the state's bytes; rank 0 prints them for all ranks."""
    import torch

    from swift_mcore._quiet import quiet_third_party

    quiet_third_party()
    from swift_mcore.arguments import RunArguments
    from swift_mcore.models.gpt import build_model, count_parameters
    from swift_mcore.run_config import resolve
    from swift_mcore.runtime import collectives, distributed, seed
    from swift_mcore.runtime.ddp import wrap_model
    from swift_mcore.training.optimizer import build_optimizer

    world = int(os.environ["WORLD_SIZE"])
    config = resolve(RunArguments.from_flags(
        **SHAPES[size], **LLAMA_SETTINGS, seq_length=32, micro_batch_size=1,
        global_batch_size=world, use_distributed_optimizer=distributed_optimizer)
    ).complete(VOCAB, None, padded_vocab_size=VOCAB)
    distributed.initialize(config)
    seed.set_seed(0)
    model = wrap_model(config, build_model(config))
    optimizer = build_optimizer(config, model)
    tokens = torch.randint(0, VOCAB, (1, 32), generator=torch.Generator().manual_seed(0))
    model[0].zero_grad_buffer()
    optimizer.zero_grad()
    out = model[0](tokens, torch.arange(32).expand(1, -1), None, labels=tokens)
    out.mean().backward()
    model[0].finish_grad_sync()
    optimizer.step()
    state_bytes = sum(t.numel() * t.element_size()
                      for part in getattr(optimizer, "chained_optimizers", [optimizer])
                      for state in part.optimizer.state.values()
                      for name, t in state.items()
                      if isinstance(t, torch.Tensor) and name != "step")
    per_rank = collectives.all_gather(state_bytes)
    if distributed.rank() == 0:
        print(json.dumps({"dp": world, "distributed_optimizer": distributed_optimizer,
                          "parameters": count_parameters(model),
                          "state_bytes_per_rank": per_rank}), flush=True)
    distributed.exit_process(0)


def measure(size: str, dp: int, distributed_optimizer: bool) -> dict:
    from run_helpers import child_env, free_port  # tests/run_helpers.py

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={dp}",
           f"--master_port={free_port()}", os.path.abspath(__file__), "--worker",
           "--size", size] + (["--distributed_optimizer"] if distributed_optimizer else [])
    env = child_env(OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"DP {dp} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--size", default="10m", choices=sorted(SHAPES))
    parser.add_argument("--tiny", action="store_true", help="--size tiny")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--distributed_optimizer", action="store_true",
                        help=argparse.SUPPRESS)
    opts = parser.parse_args()
    size = "tiny" if opts.tiny else opts.size
    if opts.worker:
        return worker(size, opts.distributed_optimizer)
    from bench_common import on_path

    on_path("tests")
    ratios = {}
    for dp in opts.dp:
        plain = measure(size, dp, False)
        sharded = measure(size, dp, True)
        print(json.dumps(plain), flush=True)
        print(json.dumps(sharded), flush=True)
        ratios[dp] = round(max(sharded["state_bytes_per_rank"])
                           / max(plain["state_bytes_per_rank"]), 4)
    print(json.dumps({"size": size, "distributed_over_plain_per_rank": ratios}), flush=True)


if __name__ == "__main__":
    main()
