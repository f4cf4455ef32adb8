"""Resume start-up time against the number of samples already consumed (must be flat).

For each consumed count C a checkpoint is made at iteration C / GBS (a real save through
the Trainer, counters set to C); then fresh processes resume from it, alternating between
the counts, and time ``Trainer.setup()`` (model, optimizer, load_checkpoint, data loader
positioned at C) and the first training step (whose batch is the one at position C).
Positioning is O(1) in C: a replay of skipped batches would show up here.

  python benchmarks/resume_startup.py                      # default model, 0 vs 10^7
  python benchmarks/resume_startup.py --tiny --repeats 1   # smoke test
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
            seq_length=32, micro_batch_size=2, global_batch_size=4)


def flags_for(opts, out, consumed):
    model = TINY if opts.tiny else {}
    gbs = model.get("global_batch_size", 16)
    iteration = consumed // gbs
    return {**model, "output_dir": out, "train_iters": iteration + 2,
            "lr_warmup_iters": 1, "lr_decay_iters": 10**8, "eval_steps": 0,
            "tensorboard": False, "progress_bar": False, "num_workers": 0,
            "data_cache_path": os.path.join(opts.workdir, "data_cache")}, iteration


def child_make(spec):
    from swift_mcore.arguments import PretrainArguments
    from swift_mcore.training.trainer import Trainer

    trainer = Trainer(PretrainArguments.from_flags(**spec["flags"]))
    trainer.setup()
    trainer.train_step()  # both checkpoints then hold the same model and optimizer state
    st = trainer.state
    st.iteration = spec["iteration"]
    st.consumed_train_samples = spec["consumed"]
    if st.iteration:
        trainer.scheduler.step(increment=st.iteration)
    trainer.save_checkpoint()
    print(json.dumps({"made": spec["consumed"]}), flush=True)


def child_resume(spec):
    t0 = time.perf_counter()
    from swift_mcore.arguments import PretrainArguments
    from swift_mcore.training.trainer import Trainer

    t_import = time.perf_counter()
    timings = {}

    class Timed(Trainer):
        def load_checkpoint(self):
            start = time.perf_counter()
            state = super().load_checkpoint()
            timings["load_checkpoint_s"] = time.perf_counter() - start
            return state

        def build_iterator(self, dataset, consumed_samples):
            start = time.perf_counter()
            it = super().build_iterator(dataset, consumed_samples)
            timings.setdefault("build_iterator_s", time.perf_counter() - start)
            return it

    trainer = Timed(PretrainArguments.from_flags(**spec["flags"], resume="auto"))
    trainer.setup()
    t_setup = time.perf_counter()
    trainer._sample_ids = []
    batch = trainer.get_batch(trainer.train_iterator)
    t_batch = time.perf_counter()
    rest = [next(trainer.train_iterator)
            for _ in range(trainer.args.derived.num_microbatches - 1)]
    trainer.train_iterator = iter([batch] + rest)  # the step trains on the batch just read
    trainer.train_step()
    t_step = time.perf_counter()
    assert trainer.state.consumed_train_samples == spec["consumed"]
    assert int(batch["sample_ids"][0]) == spec["consumed"], "the first batch is not at C"
    print(json.dumps({"consumed": spec["consumed"], "import_s": t_import - t0,
                      "setup_s": t_setup - t_import, "first_batch_s": t_batch - t_setup,
                      "first_step_s": t_step - t_batch, **timings}), flush=True)
    os._exit(0)


def run_child(mode, spec):
    proc = subprocess.run([sys.executable, __file__, f"--{mode}", json.dumps(spec)],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--consumed", type=int, nargs="+", default=[0, 10**7])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--make", help=argparse.SUPPRESS)
    parser.add_argument("--resume", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.make:
        return child_make(json.loads(opts.make))
    if opts.resume:
        return child_resume(json.loads(opts.resume))

    with tempfile.TemporaryDirectory() as workdir:
        opts.workdir = workdir
        specs = {}
        for consumed in opts.consumed:
            flags, iteration = flags_for(opts, os.path.join(workdir, f"c{consumed}"), consumed)
            specs[consumed] = {"flags": flags, "iteration": iteration,
                               "consumed": iteration * (flags.get("global_batch_size", 16))}
            run_child("make", specs[consumed])
        results = {c: [] for c in opts.consumed}
        for _ in range(opts.repeats):
            for consumed in opts.consumed:
                results[consumed].append(run_child("resume", specs[consumed]))
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
    print(json.dumps(out))


if __name__ == "__main__":
    main()
