"""Mixture of experts at TP=2 x EP=2 on 4 gloo ranks against one rank: the losses of several
steps, both token dispatchers, and a TP2 x EP2 checkpoint resumed at one rank.

Too slow for the test suite on 2 cores (four ranks per run), hence a script: each run is
`swift-mcore pt` with a tiny MoE (4 experts, top-2, dropless routing, load-balancing and
z-loss on) and --sequence_parallel, which megatron's MoE layer needs with TP. The reference
is the same model on one rank (TP = EP = 1), which saves at step 2; the 4-rank runs resume
that checkpoint (resharded to TP2 x EP2) and train steps 3..N. With 4 ranks, TP2 x EP2
leaves DP=2 for the dense part; the experts are TP-sharded (megatron's expert TP follows
TP) and split over EP. Reported as one JSON line: per dispatcher the largest |difference|
against the reference of the LM loss and of the reported router losses over steps 3..N,
and for the resume the same for steps 4..N continued at one rank from the TP2 x EP2
checkpoint of step 3 against the 4-rank run's own. "ok": every difference (LM loss,
load-balancing loss, z-loss) within --tolerance (1e-5) (the exit status is non-zero
otherwise). That holds because the router losses' coefficients are scaled by TP for
megatron-core 0.16.1 (models/gpt.py:router_loss_scale; docs/models.md).

  python benchmarks/moe_tp_ep.py                 # 5 steps
  python benchmarks/moe_tp_ep.py --iters 4       # the smoke test (tests/test_moe_runs.py)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from bench_common import ROOT, SIZES, child_env  # puts the checkout on sys.path

MODEL = [*SIZES["tiny"], "--seq_length", "32", "--micro_batch_size", "2",
         "--global_batch_size", "8", "--lr", "1e-3", "--lr_warmup_iters", "0",
         "--lr_decay_style", "constant", "--min_lr", "1e-3", "--log_interval", "1",
         "--eval_steps", "0", "--progress_bar", "false", "--tensorboard", "false",
         "--plot", "false", "--num_workers", "0",
         "--num_experts", "4", "--moe_router_topk", "2", "--moe_ffn_hidden_size", "32",
         "--moe_aux_loss_coeff", "0.01", "--moe_z_loss_coeff", "0.001"]
TP2_EP2 = ["--tensor_model_parallel_size", "2", "--expert_model_parallel_size", "2",
           "--sequence_parallel"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(out: str, *flags: str, nproc: int = 1) -> dict:
    """swift-mcore pt on nproc ranks; its train records by iteration."""
    env = child_env(PYTHONPATH=ROOT, PYTHONWARNINGS="ignore")
    if nproc > 1:
        env.update(NPROC_PER_NODE=str(nproc), MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "pt", *MODEL, *flags,
                           "--output_dir", out], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"pt {' '.join(flags)} failed:\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as fh:
        return {r["iteration"]: r for r in map(json.loads, fh) if r["split"] == "train"}


def largest_difference(got: dict, ref: dict, keys=("loss", "load_balancing_loss", "z_loss")):
    if sorted(got) != sorted(set(got) & set(ref)):
        raise SystemExit(f"iterations {sorted(got)} are not all in the reference {sorted(ref)}")
    return {key: max(abs(got[it][key] - ref[it][key]) for it in got) for key in keys}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args()
    if args.iters < 4:
        parser.error("--iters must be at least 4 (steps 3.. at TP2 x EP2, 4.. resumed)")
    iters = ["--train_iters", str(args.iters)]
    result = {"iters": args.iters, "tolerance": args.tolerance, "dispatchers": {}}
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        # The reference saves at step 2: the 4-rank runs start from there. From scratch
        # they would not start from the same weights: at EP > 1 each rank initialises its
        # own experts from the same generator state, not the slices of one rank's experts.
        ref = run(os.path.join(tmp, "ep1"), *iters, "--save_steps", "2")
        result["reference_losses"] = {it: r["loss"] for it, r in ref.items()}
        start = ["--resume", os.path.join(tmp, "ep1", "checkpoint", "iter_0000002")]
        for dispatcher in ("alltoall", "allgather"):
            out = os.path.join(tmp, dispatcher)
            save = ["--save_steps", "3"] if dispatcher == "alltoall" else ["--no_save"]
            got = run(out, *iters, *TP2_EP2, "--moe_token_dispatcher_type", dispatcher,
                      *start, *save, nproc=4)
            result["dispatchers"][dispatcher] = largest_difference(got, ref)
            if dispatcher == "alltoall":
                tp2ep2 = got
        # The TP2 x EP2 checkpoint of step 3 continued at TP = EP = 1.
        resumed = run(os.path.join(tmp, "resumed"), *iters, "--no_save", "--resume",
                      os.path.join(tmp, "alltoall", "checkpoint", "iter_0000003"))
        result["resume_tp2ep2_to_ep1"] = largest_difference(resumed, tp2ep2)
        result["resumed_iterations"] = sorted(resumed)
    # The LM loss and the reported router losses (the full batch's at any layout,
    # training/moe_metrics.py) are all checked.
    checked = [*result["dispatchers"].values(), result["resume_tp2ep2_to_ep1"]]
    result["ok"] = all(value <= args.tolerance for c in checked for value in c.values()) \
        and result["resumed_iterations"] == list(range(4, args.iters + 1))
    result["seconds"] = round(time.time() - started, 1)
    print(json.dumps(result))
    if not result["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
