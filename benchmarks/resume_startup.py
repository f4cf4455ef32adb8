"""Resume start-up time against the number of samples already consumed (must be flat),
side by side with the Hugging Face Trainer's batch skipping.

For each consumed count C a checkpoint is made at iteration C / GBS (a real save through
the Trainer, counters set to C); then fresh processes resume from it, alternating between
the counts, and time ``Trainer.setup()`` (model, optimizer, the checkpoint load: plan_load
then restore, data loader positioned at C) and the first training step (whose batch is the one at position C).
Positioning is O(1) in C: a replay of skipped batches would show up here.

The peer (benchmarks/hf_peer.py: the equivalent LlamaForCausalLM, same rows, same micro
and global batch) resumes from a checkpoint at global step C / GBS through
``Trainer.train(resume_from_checkpoint=...)`` with ``ignore_data_skip=False`` (the default,
the exact-resume path): it skips whole epochs for free, then walks ``skip_first_batches``
(accelerate's SkipBatchSampler) over the batches already seen in the current epoch. Three
datasets, all the rows of swift-mcore's training split:

* ``hf_same_data``: those rows as they are (the embedded corpus: ~6.7k samples per epoch,
  so 10^7 samples is epoch ~1490 and at most one epoch is skipped);
* ``hf_one_epoch``: the same rows repeated to one epoch longer than C, the case of a
  pretraining corpus that is not yet through its first epoch;
* ``hf_streaming``: that one epoch as an IterableDataset (a streamed corpus), where
  skipping means reading every sample before C.

Every run is timed from its first line (interpreter start-up is not counted, for either):
imports, set-up, the first batch and the first step. Streaming runs above
--hf_streaming_cap samples are not run but extrapolated (the skipping is linear in C:
seconds per sample of the largest run). --hf_variants picks the HF datasets.

  python benchmarks/resume_startup.py                      # default model, 0, 1e5, 1e7
  python benchmarks/resume_startup.py --no_hf              # swift-mcore only
  python benchmarks/resume_startup.py --tiny --repeats 1 --consumed 400 \\
      --hf_variants hf_streaming                           # smoke test
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench_common import ROOT, SHAPES  # puts the checkout on sys.path

TINY = dict(SHAPES["tiny"], seq_length=32, micro_batch_size=2, global_batch_size=4)


def flags_for(opts, out, consumed):
    model = TINY if opts.tiny else {}
    gbs = model.get("global_batch_size", 16)
    iteration = consumed // gbs
    return {**model, "output_dir": out, "train_iters": iteration + 2,
            "lr_warmup_iters": 1, "lr_decay_iters": 10**8, "eval_steps": 0,
            "tensorboard": False, "progress_bar": False, "num_workers": 0,
            "data_cache_path": os.path.join(opts.workdir, "data_cache")}, iteration


def child_make(spec):
    from swift_mcore.arguments import RunArguments
    from swift_mcore.training.trainer import Trainer

    trainer = Trainer(RunArguments.from_flags(**spec["flags"]))
    trainer.setup()
    trainer.train_step()  # both checkpoints then hold the same model and optimizer state
    st = trainer.state
    st.iteration = spec["iteration"]
    st.consumed_train_samples = spec["consumed"]
    if st.iteration:
        trainer.scheduler.step(increment=st.iteration)
    trainer.save_checkpoint()
    print(json.dumps({"made": spec["consumed"]}), flush=True)


def timed(module, name, timings, key):
    """Wrap ``module.name`` so that each call adds its seconds to ``timings[key]``."""
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            timings[key] = timings.get(key, 0.0) + time.perf_counter() - start

    setattr(module, name, wrapper)


def child_resume(spec):
    t0 = time.perf_counter()
    from swift_mcore.arguments import RunArguments
    from swift_mcore.checkpointing import load
    from swift_mcore.training.trainer import Trainer

    t_import = time.perf_counter()
    timings = {}
    # The checkpoint load: which checkpoint and whether it may be resumed (plan_load, before
    # the data), then model, optimizer, scheduler, RNG and counters (restore).
    timed(load, "plan_load", timings, "plan_load_s")
    timed(load, "restore", timings, "restore_s")

    class Timed(Trainer):
        def build_iterator(self, dataset, consumed_samples):
            start = time.perf_counter()
            it = super().build_iterator(dataset, consumed_samples)
            timings.setdefault("build_iterator_s", time.perf_counter() - start)
            return it

    trainer = Timed(RunArguments.from_flags(**spec["flags"], resume="auto"))
    trainer.setup()
    t_setup = time.perf_counter()
    assert "restore_s" in timings, "setup did not restore the checkpoint"
    timings["load_checkpoint_s"] = timings["plan_load_s"] + timings["restore_s"]
    batch = trainer.get_batch(trainer.train_iterator)
    t_batch = time.perf_counter()
    rest = [next(trainer.train_iterator)
            for _ in range(trainer.config.world.num_microbatches - 1)]
    trainer.train_iterator = iter([batch] + rest)  # the step trains on the batch just read
    trainer.train_step()
    t_step = time.perf_counter()
    assert trainer.state.consumed_train_samples == spec["consumed"]
    assert int(batch["sample_ids"][0]) == spec["consumed"], "the first batch is not at C"
    print(json.dumps({"consumed": spec["consumed"], "import_s": t_import - t0,
                      "setup_s": t_setup - t_import, "first_batch_s": t_batch - t_setup,
                      "first_step_s": t_step - t_batch, **timings}), flush=True)
    os._exit(0)


HF_VARIANTS = ("hf_same_data", "hf_one_epoch", "hf_streaming")


def hf_trainer(spec, rows, max_steps, clock=None, **overrides):
    from transformers import Trainer
    from transformers.utils import logging as hf_logging

    from hf_peer import Rows, StreamedRows, build_model, training_arguments
    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve

    hf_logging.set_verbosity_error()
    args = resolve(RunArguments.from_flags(**spec["flags"]))
    # One epoch that outlasts the resume point (plus the step to train), or the rows as they
    # are (hf_same_data: many epochs).
    length = spec["consumed"] + 4 * args.training.global_batch_size
    dataset = {"hf_same_data": lambda: Rows(rows["tokens"]),
               "hf_one_epoch": lambda: Rows(rows["tokens"], length),
               "hf_streaming": lambda: StreamedRows(rows["tokens"], length)}[spec["variant"]]()
    return Trainer(model=build_model(args, rows["vocab_size"]), train_dataset=dataset,
                   callbacks=[clock] if clock else [],
                   args=training_arguments(args, spec["out"], max_steps, 0, **overrides))


def child_hf_make(spec):
    """The rows of swift-mcore's training split (the peer's data), then one real HF step
    saved as checkpoint-1 (model, optimizer, scheduler, RNG, trainer state)."""
    import torch

    from swift_mcore.arguments import RunArguments
    from swift_mcore.data import build_datasets, build_tokenizer
    from swift_mcore.run_config import resolve
    from swift_mcore.runtime import distributed

    args = resolve(RunArguments.from_flags(**spec["flags"]))
    distributed.initialize(args)
    tokenizer = build_tokenizer(args)
    train, _, _ = build_datasets(args, tokenizer)
    args = args.complete(tokenizer.vocab_size, len(train))
    rows = {"tokens": torch.stack([torch.as_tensor(train[i]["tokens"])
                                   for i in range(len(train))]).long(),
            "vocab_size": args.padded_vocab_size}
    torch.save(rows, spec["rows"])
    hf_trainer(spec, rows, 1, save_strategy="steps", save_steps=1).train()
    print(json.dumps({"rows": len(train)}), flush=True)
    os._exit(0)


def child_hf_resume(spec):
    t0 = time.perf_counter()
    import torch
    from transformers import Trainer  # noqa: F401  (import cost is start-up, as for swift)

    from hf_peer import step_clock

    t_import = time.perf_counter()
    clock = step_clock()
    trainer = hf_trainer(spec, torch.load(spec["rows"], weights_only=True), spec["step"] + 1,
                         clock)
    t_setup = time.perf_counter()
    trainer.train(resume_from_checkpoint=spec["checkpoint"])
    assert trainer.state.global_step == spec["step"] + 1, trainer.state.global_step
    print(json.dumps({
        "consumed": spec["consumed"], "import_s": t_import - t0, "setup_s": t_setup - t_import,
        # train() up to on_train_begin: model, optimizer, scheduler and RNG state restored.
        "load_checkpoint_s": clock.begin - t_setup,
        # on_train_begin to the first step's start: the skipped batches and the first one.
        "skip_and_first_batch_s": clock.step_begins[0] - clock.begin,
        "first_step_s": clock.step_ends[0] - clock.step_begins[0],
        "total_s": clock.step_ends[0] - t0}), flush=True)
    os._exit(0)


def hf_counts(variant, counts, cap):
    """The counts an HF variant really runs: streaming skips by reading every sample, so
    above --hf_streaming_cap it runs at the cap and is extrapolated."""
    if variant != "hf_streaming" or all(c <= cap for c in counts):
        return list(counts)
    return sorted({c for c in counts if c <= cap} | {cap})


def make_hf_checkpoints(opts, workdir, flags, counts):
    """One checkpoint-1, copied per variant and count as checkpoint-S with trainer_state.json
    at global step S = C / GBS. Its optimizer and scheduler state are step 1's: restoring
    them costs the same at any step, and the data skip follows from global_step alone."""
    import shutil

    gbs = flags.get("global_batch_size", 16)
    base = {"flags": flags, "rows": os.path.join(workdir, "hf_rows.pt"),
            "variant": "hf_same_data", "consumed": 0, "out": os.path.join(workdir, "hf_make")}
    run_child("hf_make", base)
    specs = {}
    for variant in opts.hf_variants:
        for consumed in hf_counts(variant, counts, opts.hf_streaming_cap):
            step = consumed // gbs
            out = os.path.join(workdir, f"{variant}_{consumed}")
            checkpoint = os.path.join(out, f"checkpoint-{step}")
            shutil.copytree(os.path.join(base["out"], "checkpoint-1"), checkpoint)
            state_file = os.path.join(checkpoint, "trainer_state.json")
            with open(state_file, encoding="utf-8") as fh:
                state = json.load(fh)
            state["global_step"] = step
            with open(state_file, "w", encoding="utf-8") as fh:
                json.dump(state, fh)
            specs[(variant, consumed)] = {**base, "variant": variant, "out": out,
                                          "consumed": consumed, "step": step,
                                          "checkpoint": checkpoint}
    return specs


def summarize_hf(hf_results, counts, swift_summary):
    hf = {}
    for (variant, consumed), runs in hf_results.items():
        hf.setdefault(variant, {})[str(consumed)] = {
            k: round(statistics.median(r[k] for r in runs), 4)
            for k in runs[0] if k.endswith("_s")}
    for variant, measured in hf.items():
        # Linear in the samples skipped: seconds per sample from the largest run.
        top = max(measured, key=int)
        per_sample = measured[top]["skip_and_first_batch_s"] / max(int(top), 1)
        for consumed in counts:
            if str(consumed) not in measured:
                measured[str(consumed)] = {
                    "total_s": round(measured[top]["total_s"]
                                     + per_sample * (consumed - int(top)), 2),
                    "extrapolated_from": int(top)}
        hf[variant] = dict(sorted(measured.items(), key=lambda kv: int(kv[0])))
    ratios = {variant: {c: round(v["total_s"] / swift_summary[c]["total_s"], 3)
                        for c, v in per_count.items() if c in swift_summary}
              for variant, per_count in hf.items()}
    return hf, ratios


def run_child(mode, spec):
    proc = subprocess.run([sys.executable, __file__, f"--{mode}", json.dumps(spec)],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--consumed", type=int, nargs="+", default=[0, 10**5, 10**7])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--no_hf", action="store_true", help="skip the HF Trainer peer")
    parser.add_argument("--hf_streaming_cap", type=int, default=10**6,
                        help="streaming HF runs above this many samples are extrapolated")
    parser.add_argument("--hf_variants", nargs="+", default=list(HF_VARIANTS),
                        choices=HF_VARIANTS, help="the HF datasets to resume on")
    for mode in ("make", "resume", "hf_make", "hf_resume"):
        parser.add_argument(f"--{mode}", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    for mode in ("make", "resume", "hf_make", "hf_resume"):
        if getattr(opts, mode):
            return globals()[f"child_{mode}"](json.loads(getattr(opts, mode)))

    with tempfile.TemporaryDirectory() as workdir:
        opts.workdir = workdir
        specs = {}
        for consumed in opts.consumed:
            flags, iteration = flags_for(opts, os.path.join(workdir, f"c{consumed}"), consumed)
            specs[consumed] = {"flags": flags, "iteration": iteration,
                               "consumed": iteration * (flags.get("global_batch_size", 16))}
            run_child("make", specs[consumed])
        hf_specs = {} if opts.no_hf else make_hf_checkpoints(
            opts, workdir, flags_for(opts, os.path.join(workdir, "hf"), 0)[0],
            [specs[c]["consumed"] for c in opts.consumed])
        results = {c: [] for c in opts.consumed}
        hf_results = {key: [] for key in hf_specs}
        for _ in range(opts.repeats):  # alternating, so drifting machine load hits all alike
            for consumed in opts.consumed:
                results[consumed].append(run_child("resume", specs[consumed]))
            for key, spec in hf_specs.items():
                hf_results[key].append(run_child("hf_resume", spec))
    summary = {}
    for consumed, runs in results.items():
        keys = [k for k in runs[0] if k.endswith("_s")]
        summary[str(specs[consumed]["consumed"])] = {
            k: round(statistics.median(r[k] for r in runs), 4) for k in keys}
    first, last = (summary[str(specs[c]["consumed"])] for c in (opts.consumed[0],
                                                               opts.consumed[-1]))
    out = {"repeats": opts.repeats, "tiny": opts.tiny, "median": summary,
           "setup_plus_first_step_ratio": round(
               (last["setup_s"] + last["first_batch_s"] + last["first_step_s"])
               / (first["setup_s"] + first["first_batch_s"] + first["first_step_s"]), 3)}
    for consumed, runs in results.items():
        for run in runs:
            run["total_s"] = sum(run[k] for k in ("import_s", "setup_s", "first_batch_s",
                                                  "first_step_s"))
        summary[str(specs[consumed]["consumed"])]["total_s"] = round(
            statistics.median(r["total_s"] for r in runs), 4)
    if hf_results:
        # Process start to the first step done, over swift-mcore's, per count.
        out["hf"], out["hf_total_over_swift"] = summarize_hf(
            hf_results, [specs[c]["consumed"] for c in opts.consumed], summary)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
