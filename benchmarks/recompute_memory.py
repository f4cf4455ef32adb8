"""Activation memory with and without activation recompute: the bytes autograd keeps for the
backward pass of one micro-batch, the process's peak RSS, and the step time, per setting.

    .venv/bin/python benchmarks/recompute_memory.py            # 8 layers, hidden 512, seq 1024
    .venv/bin/python benchmarks/recompute_memory.py --tiny     # a moment (smoke test)

Each setting runs in its own process (so its peak RSS is its own): one tiny-data forward and
backward of megatron's GPTModel on CPU (fp32, local spec with sdpa, dropout 0.1) built from
swift-mcore's RunConfig. "saved" counts the storages autograd holds for backward when the
forward ends (parameters left out; the norms' outputs that selective recompute frees count
0), so it is exact and does not depend on the machine's load; the times are ratios against
no recompute measured in the same run. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from bench_common import ROOT  # puts the checkout on sys.path

SETTINGS = {
    "none": {},
    "selective core_attn": dict(recompute_granularity="selective"),
    "selective core_attn,layernorm,mlp": dict(recompute_granularity="selective",
                                              recompute_modules=["core_attn", "layernorm",
                                                                 "mlp"]),
    "full block 4": dict(recompute_granularity="full", recompute_method="block",
                         recompute_num_layers=4),
    "full uniform 1": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=1),
}


def one(setting: str, tiny: bool, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    from swift_mcore.runtime.cpu import cpu_compat

    cpu_compat.activate()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29911"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    from swift_mcore.arguments import RunArguments
    from swift_mcore.models.gpt import build_model
    from swift_mcore.run_config import resolve
    from swift_mcore.runtime import seed

    shape = (dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  seq_length=64) if tiny else
             dict(num_layers=8, hidden_size=512, num_attention_heads=8, num_query_groups=4,
                  seq_length=1024))
    flags = dict(shape, micro_batch_size=2, global_batch_size=2, hidden_dropout=0.1,
                 attention_dropout=0.1, attention_backend="sdpa", **SETTINGS[setting])
    if tiny and flags.get("recompute_num_layers") == 4:
        flags["recompute_num_layers"] = 2
    config = resolve(RunArguments.from_flags(**flags), world_size=1, cuda=False).complete(
        4096, None)
    seed.set_seed(0)
    model = build_model(config)[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seq = shape["seq_length"]
    tokens = torch.randint(0, 4096, (2, seq), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(seq).expand(2, seq)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), 1)
    saved_bytes, times = 0, []
    for step in range(steps + 1):  # the first step warms up
        kept = []
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t,
                                                      lambda t: t):
            loss = model(input_ids=tokens, position_ids=positions, attention_mask=mask,
                         labels=tokens).float().mean()
        storages = {}
        for t in kept:
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                storages[s.data_ptr()] = s.nbytes()
        saved_bytes = sum(storages.values())
        del kept, storages
        loss.backward()
        model.zero_grad(set_to_none=True)
        if step:
            times.append(time.perf_counter() - start)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"setting": setting, "saved_MB": round(saved_bytes / 2**20, 2),
            "peak_rss_MB": round(rss / 2**20), "step_s": min(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.one:
        print(json.dumps(one(opts.one, opts.tiny, opts.steps)), flush=True)
        os._exit(0)  # skip gloo's interpreter teardown (docs/cpu.md)
    rows = []
    for i, setting in enumerate(SETTINGS):
        env = dict(os.environ, PORT=str(29911 + i), PYTHONWARNINGS="ignore")
        proc = subprocess.run([sys.executable, __file__, "--one", setting, "--steps",
                               str(opts.steps), *(["--tiny"] if opts.tiny else [])],
                              capture_output=True, text=True, env=env, cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(f"{setting} failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    base = rows[0]
    for row in rows:
        row["saved_ratio"] = round(row["saved_MB"] / base["saved_MB"], 3)
        row["time_ratio"] = round(row["step_s"] / base["step_s"], 2)
        row["rss_ratio"] = round(row["peak_rss_MB"] / base["peak_rss_MB"], 3)
    print(json.dumps({"tiny": opts.tiny, "settings": rows}))


if __name__ == "__main__":
    main()
