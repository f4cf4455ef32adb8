"""Training throughput of swift-mcore against a bare megatron-core loop and the HF Trainer.

The same Llama-style model (SwiGLU, RMSNorm, RoPE, grouped-query attention, untied
embeddings) at two sizes and two sequence lengths, the same rows of data and the same
global batch for every contender:

* ``swift-mcore``       `swift-mcore pt` (the CLI) with its defaults: ``--attention_backend
                        auto``, torch's SDPA on CPU (Transformer Engine's on CUDA with TE);
* ``swift-mcore-local`` the same with ``--attention_backend local`` (megatron's
                        DotProductAttention, the default before issue 14);
* ``swift-mcore-trim-heap`` the default with ``--trim_host_memory true`` (the free heap
                        handed back before each micro-batch: what the trim saves and costs);
* ``megatron-bare``     benchmarks/bare_megatron_loop.py, the same megatron model in a bare
                        loop (the framework-overhead baseline; the attention auto chooses);
* ``hf-trainer``        benchmarks/hf_peer.py, transformers' Trainer on the equivalent
                        LlamaForCausalLM (sdpa attention, fused AdamW).

Each contender runs in its own process (peak RSS: ru_maxrss from wait4), in an order that
rotates every round, so drifting load on a shared machine hits all alike. Per run: tokens/s
over the timed steps after --warmup steps. Per contender: the median over rounds and the
best run. Ratios are taken against megatron-bare within each round, then the median of
those is reported (and best over best). Model FLOPs: swift_mcore.training.metrics
(6 x matmul parameters + 12 x layers x seq x attention width per token, causal mask not
discounted). Utilisation: model FLOP/s over the fp32 matrix-multiply peak this script
measures on the same machine between rounds (the best of several torch.mm sizes).

  python benchmarks/throughput.py                                   # all four cases, CPU
  python benchmarks/throughput.py --sizes 100m --seqs 1024 --rounds 3
  python benchmarks/throughput.py --device cuda                     # GPU: bf16, MFU
  python benchmarks/throughput.py --tiny --rounds 1                 # smoke test

With --device cuda the contenders train in bf16 (swift-mcore --bf16, HF bf16=True) with
larger batches, and MFU is reported against the GPU's dense bf16 peak (a table of known
GPUs, else the measured bf16 matmul peak; both are printed). Prints one JSON line;
--table also prints markdown rows to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# heap_phases.py and rss_breakdown.py read SIZES from here too.
# bench_common puts the checkout on sys.path
from bench_common import LLAMA, ROOT, SIZES, child_env as launch_free_env

# (micro batch, global batch, warmup steps, timed steps) per device and size: on 2 CPU
# cores a 100M step at seq 1024 takes about half a minute.
BATCH = {
    ("cpu", "10m"): (2, 8, 2, 6), ("cpu", "100m"): (2, 4, 1, 3), ("cpu", "tiny"): (2, 4, 1, 2),
    ("cpu", "vocab152k"): (2, 4, 1, 3), ("cuda", "vocab152k"): (8, 64, 5, 20),
    ("cuda", "10m"): (8, 64, 5, 20), ("cuda", "100m"): (8, 64, 5, 20),
    ("cuda", "tiny"): (2, 4, 1, 2),
}
CONTENDERS = ("swift-mcore", "swift-mcore-local", "swift-mcore-trim-heap", "megatron-bare",
              "hf-trainer")
BASELINE = "megatron-bare"


# ---- the machine's matmul peak ------------------------------------------------------------

def matmul_peak(device: str, quick: bool = False) -> float:
    """Best FLOP/s of torch.mm on square matrices: fp32 on CPU (all threads), bf16 on GPU,
    measured as swift-mcore's MFU peak is (training/peak.py), on larger CPU sizes.
    ``quick`` (smoke test) tries small sizes only."""
    from swift_mcore.training.peak import measure_matmul_tflops

    sizes = (512,) if quick else (1024, 2048, 4096)
    return measure_matmul_tflops(device, sizes=sizes, repeats=10 if device == "cuda" else 4
                                 ) * 1e12


def nominal_bf16_peak():
    """The GPU's name and its data-sheet dense bf16 peak in FLOP/s (training/peak.py's table;
    None for a GPU it does not list)."""
    import torch

    from swift_mcore.training.peak import data_sheet_peak

    name = torch.cuda.get_device_name()
    found = data_sheet_peak(name)
    return name, found[1] * 1e12 if found else None


# ---- running one contender ------------------------------------------------------------------

def run_measured(cmd, env):
    """Runs cmd; returns (stdout, stderr, peak RSS of the process in MB, wall seconds, the
    share of all cores the process used)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT, env=env)
        # wait4 reports this child's own resource usage, so each contender's peak RSS is
        # its own (getrusage(RUSAGE_CHILDREN) would give the maximum over all of them).
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}):\n"
                         f"{stdout[-2000:]}\n{stderr[-4000:]}")
    # The share of the machine's cores this process got: on a shared machine, other
    # processes taking cores show up here as a low share.
    cpu_share = (usage.ru_utime + usage.ru_stime) / wall / os.cpu_count()
    return stdout, stderr, usage.ru_maxrss / 1024, wall, cpu_share


def child_env(device):
    env = launch_free_env(PYTHONWARNINGS="ignore")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU numbers even on a machine with a GPU
    return env


def run_contender(name, flags, case, opts, workdir):
    env = child_env(opts.device)
    timing = ["--iters", str(case["iters"]), "--warmup", str(case["warmup"])]
    if name.startswith("swift-mcore"):
        out = tempfile.mkdtemp(dir=workdir)
        backend = {"swift-mcore-local": ["--attention_backend", "local"],
                   "swift-mcore-trim-heap": ["--trim_host_memory", "true"]}.get(name, [])
        cmd = [sys.executable, "-m", "swift_mcore", "pt", *flags, *backend,
               "--train_iters", str(case["warmup"] + case["iters"]), "--log_interval", "1",
               "--eval_steps", "0", "--no_save", "--progress_bar", "false",
               "--tensorboard", "false", "--output_dir", out]
        _, _, rss, wall, share = run_measured(cmd, env)
        with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as fh:
            records = [json.loads(line) for line in fh if line.strip()]
        rates = [r["tokens_per_s"] for r in records if r["split"] == "train"]
        steps = [case["tokens"] / r for r in rates][case["warmup"]:]
        result = {"step_s": steps, "parameters": None}
    elif name == "megatron-bare":
        cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bare_megatron_loop.py"),
               *timing, "--data_file", case["data_file"], *flags]
        stdout, _, rss, wall, share = run_measured(cmd, env)
        result = json.loads(stdout.strip().splitlines()[-1])
    elif name == "hf-trainer":
        cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "hf_peer.py"), *timing,
               "--data_file", case["data_file"], "--hf_attention", opts.hf_attention, *flags]
        stdout, _, rss, wall, share = run_measured(cmd, env)
        result = json.loads(stdout.strip().splitlines()[-1])
    else:
        raise ValueError(name)
    steps = result["step_s"]
    return {"tokens_per_s": case["tokens"] * len(steps) / sum(steps), "rss_MB": rss,
            "best_step_tokens_per_s": case["tokens"] / min(steps), "wall_s": wall,
            "cpu_share": round(share, 3), "parameters": result.get("parameters"),
            "step_s": [round(s, 3) for s in steps]}


# ---- the data every contender trains on -----------------------------------------------------

def child_prepare(spec):
    """Writes the rows swift-mcore's loader yields for the first steps (global order from
    position 0), so the bare loop and the HF Trainer train on the same samples."""
    import torch

    from swift_mcore._quiet import quiet_third_party

    quiet_third_party()
    from swift_mcore.arguments import parse_args
    from swift_mcore.data import build_data_iterator, build_datasets, build_tokenizer
    from swift_mcore.models.gpt import build_model, count_parameters  # noqa: F401
    from swift_mcore.run_config import resolve
    from swift_mcore.runtime import distributed
    from swift_mcore.training.metrics import flops_per_token

    # The rows are read in this process (--num_workers 0); the datasets do not depend on it.
    args = resolve(parse_args([*spec["flags"], "--num_workers", "0"]))
    distributed.initialize(args)
    tokenizer = build_tokenizer(args)
    train, _, _ = build_datasets(args, tokenizer)
    args = args.complete(tokenizer.vocab_size, len(train))
    vocab = args.padded_vocab_size
    iterator = build_data_iterator(train, 0, args)
    batches = [next(iterator) for _ in range(spec["micro_batches"])]
    torch.save({"tokens": torch.cat([b["tokens"] for b in batches]),
                "labels": torch.cat([b["labels"] for b in batches]),
                "vocab_size": vocab}, spec["data_file"])
    print(json.dumps({"vocab_size": vocab, "flops_per_token": flops_per_token(args),
                      "ffn_hidden_size": args.model.ffn_hidden_size}), flush=True)
    distributed.shutdown()


def prepare_case(size, seq, opts, workdir):
    mbs, gbs, warmup, iters = BATCH[(opts.device, size)]
    warmup, iters = opts.warmup if opts.warmup is not None else warmup, opts.iters or iters
    flags = [*SIZES[size], *LLAMA, "--seq_length", str(seq), "--micro_batch_size", str(mbs),
             "--global_batch_size", str(gbs), "--lr_warmup_iters", "1",
             "--num_workers", str(opts.num_workers),
             "--data_cache_path", os.path.join(workdir, "data_cache")]
    if opts.device == "cuda":
        flags += ["--bf16"]
    data_file = os.path.join(workdir, f"rows_{size}_{seq}.pt")
    spec = {"flags": flags, "data_file": data_file,
            "micro_batches": (warmup + iters) * (gbs // mbs)}
    stdout = run_measured(
        [sys.executable, __file__, "--prepare", json.dumps(spec)], child_env(opts.device))[0]
    info = json.loads(stdout.strip().splitlines()[-1])
    return {"size": size, "seq_length": seq, "micro_batch_size": mbs,
            "global_batch_size": gbs, "warmup": warmup, "iters": iters,
            "tokens": gbs * seq, "data_file": data_file, "flags": flags, **info}


# ---- summary --------------------------------------------------------------------------------

def summarize(case, runs, peaks, opts):
    peak = max(peaks)
    flops = case["flops_per_token"]
    out = {k: case[k] for k in ("size", "seq_length", "micro_batch_size", "global_batch_size",
                                "warmup", "iters", "flops_per_token")}
    params = {r["parameters"] for rs in runs.values() for r in rs if r["parameters"]}
    if len(params) > 1:
        raise SystemExit(f"the contenders' models differ: {sorted(params)} parameters")
    out["parameters"] = params.pop() if params else None
    contenders = {}
    for name, rs in runs.items():
        rates = [r["tokens_per_s"] for r in rs]
        med = statistics.median(rates)
        contenders[name] = {
            "tokens_per_s_median": round(med, 1), "tokens_per_s_best": round(max(rates), 1),
            # The fastest single step of all runs: the least disturbed on a shared machine.
            "best_step_tokens_per_s": round(max(r["best_step_tokens_per_s"] for r in rs), 1),
            "tflops_median": round(med * flops / 1e12, 4),
            "utilisation_median": round(med * flops / peak, 4),
            "rss_MB_median": round(statistics.median(r["rss_MB"] for r in rs)),
            "tokens_per_s_runs": [round(x, 1) for x in rates],
            "cpu_share_runs": [r["cpu_share"] for r in rs],
        }
    out["contenders"] = contenders
    if BASELINE in runs:
        base = runs[BASELINE]
        for name, rs in runs.items():
            round_ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rs, base)]
            contenders[name]["vs_bare_median"] = round(statistics.median(round_ratios), 3)
            contenders[name]["vs_bare_best"] = round(
                max(r["tokens_per_s"] for r in rs) / max(b["tokens_per_s"] for b in base), 3)
    if "hf-trainer" in runs:
        hf = runs["hf-trainer"]
        for name, rs in runs.items():
            round_ratios = [r["tokens_per_s"] / h["tokens_per_s"] for r, h in zip(rs, hf)]
            contenders[name]["vs_hf_median"] = round(statistics.median(round_ratios), 3)
    return out


def table_rows(result):
    lines = []
    for case in result["cases"]:
        for name, c in case["contenders"].items():
            lines.append(
                f"| {case['size']} | {case['seq_length']} | {name} | "
                f"{c['tokens_per_s_median']:.0f} | {c['tokens_per_s_best']:.0f} | "
                f"{c.get('vs_bare_median', float('nan')):.3f} | "
                f"{c.get('vs_hf_median', float('nan')):.3f} | {c['tflops_median']:.3f} | "
                f"{100 * c['utilisation_median']:.1f}% | {c['rss_MB_median']} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--sizes", nargs="+", default=["10m", "100m"], choices=sorted(SIZES))
    parser.add_argument("--seqs", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, help="timed steps per run (default: per size)")
    parser.add_argument("--warmup", type=int, help="untimed first steps (default: per size)")
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS),
                        choices=CONTENDERS)
    parser.add_argument("--hf_attention", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--num_workers", type=int, default=1,
                        help="data-loader workers of swift-mcore and the HF Trainer")
    parser.add_argument("--tiny", action="store_true", help="tiny model, seq 32 (smoke test)")
    parser.add_argument("--table", action="store_true", help="markdown rows to stderr")
    parser.add_argument("--prepare", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.prepare:
        return child_prepare(json.loads(opts.prepare))
    if opts.tiny:
        opts.sizes, opts.seqs = ["tiny"], [32]
    skipped = {}
    if opts.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible")
        # --attention_backend local is obeyed with Transformer Engine installed too (megatron's
        # local layer spec), so every contender runs.

    import torch

    peaks = [matmul_peak(opts.device, opts.tiny)]
    result = {"device": opts.device, "torch_threads": torch.get_num_threads(),
              "rounds": opts.rounds, "hf_attention": opts.hf_attention,
              "num_workers": opts.num_workers, "skipped": skipped, "cases": []}
    with tempfile.TemporaryDirectory(prefix="throughput_") as workdir:
        for size in opts.sizes:
            for seq in opts.seqs:
                case = prepare_case(size, seq, opts, workdir)
                runs = {name: [] for name in opts.contenders}
                for r in range(opts.rounds):
                    names = list(opts.contenders)
                    names = names[r % len(names):] + names[:r % len(names)]
                    for name in names:
                        runs[name].append(run_contender(name, case["flags"], case, opts,
                                                        workdir))
                    peaks.append(matmul_peak(opts.device, opts.tiny))
                result["cases"].append(summarize(case, runs, peaks, opts))
    result["matmul_peak_tflops"] = round(max(peaks) / 1e12, 4)
    result["matmul_peak_runs_tflops"] = [round(p / 1e12, 4) for p in peaks]
    if opts.device == "cuda":
        name, nominal = nominal_bf16_peak()
        result["gpu"] = name
        result["bf16_peak_tflops_nominal"] = nominal and nominal / 1e12
        if nominal:  # MFU against the data-sheet peak; utilisation stays against the measured
            for case in result["cases"]:
                for c in case["contenders"].values():
                    c["mfu_median"] = round(c["tflops_median"] * 1e12 / nominal, 4)
    print(json.dumps(result), flush=True)
    if opts.table:
        print(table_rows(result), file=sys.stderr)


if __name__ == "__main__":
    main()
