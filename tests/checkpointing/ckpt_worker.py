"""One rank of one training segment for the checkpoint tests: ``python ckpt_worker.py
SPEC.json``. Trains with the real Trainer and records, per iteration, the loss, the
learning rate, the counters and every sample's global position with a CRC of its tokens
(``trace_r{rank}.jsonl`` under --output_dir, appended, flushed per line)."""

import json
import os
import sys
import time
import traceback
import zlib


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as fh:
        spec = json.load(fh)
    flags = spec["flags"]
    out = flags["output_dir"]
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(out, exist_ok=True)

    # As the CLI does for the ranks it starts (cli.main), before megatron is imported: on
    # CPU its fusions stay uncompiled functions, with the same losses, and start-up is
    # seconds shorter. Else a worker's start-up would depend on whether an earlier
    # in-process test happened to set TORCHDYNAMO_DISABLE in the test process.
    from swift_mcore.runtime import cpu

    cpu.before_import()

    import torch
    import torch.distributed as dist

    from swift_mcore.arguments import RunArguments
    from swift_mcore.training.trainer import Trainer, model_is_training

    def append(name, record):
        with open(os.path.join(out, f"{name}_r{rank}.jsonl"), "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()

    class RecordingTrainer(Trainer):
        _rows = None

        def setup(self):
            super().setup()
            s = self.state
            append("setup", {"state": s.to_dict(), "train_len": len(self.train_ds),
                             "valid_len": len(self.valid_ds) if self.valid_ds else 0,
                             "pid": os.getpid(), "time": time.time()})

        def get_batch(self, data_iterator):
            batch = super().get_batch(data_iterator)
            if model_is_training(self.model):
                tokens = batch["tokens"].cpu()
                for sid, row in zip(batch["sample_ids"].tolist(), tokens):
                    self._rows.append([sid, zlib.crc32(row.numpy().tobytes())])
            return batch

        def train_step(self):
            # spec "fail" / "stall": {"iteration": I, "rank": R}: that rank raises, or stops
            # making progress (sleeps), in iteration I (the elastic and watchdog tests).
            self._rows = []
            for what in ("fail", "stall"):
                hook = spec.get(what)
                if hook and self.state.iteration + 1 == hook["iteration"] \
                        and rank == hook["rank"]:
                    if what == "fail":
                        raise RuntimeError(f"planted failure in iteration {hook['iteration']}")
                    time.sleep(3600)
            return super().train_step()

        def advance(self, step):
            super().advance(step)
            s = self.state
            append("trace", {"iteration": s.iteration, "loss": step.get("loss"),
                             "lr": step.get("lr"), "consumed": s.consumed_train_samples,
                             "consumed_valid": s.consumed_valid_samples,
                             "samples": self._rows})

        def compute_loss(self, batch, output_tensor):
            # spec "poison": {"iterations": [...], "ranks": [...] (default all), "what": "loss"
            # (the reported loss is nan, the gradients finite), "grad" (the gradients are
            # nan, the reported loss finite) or "both"}: a non-finite step on demand.
            loss, targets, report = super().compute_loss(batch, output_tensor)
            poison = spec.get("poison")
            if (poison and model_is_training(self.model)
                    and self.state.iteration + 1 in poison["iterations"]
                    and rank in poison.get("ranks", [rank])):
                nan = float("nan")
                if poison["what"] in ("loss", "both"):
                    report = {"lm loss": report["lm loss"] * torch.tensor([nan, 1.0, 1.0])}
                if poison["what"] in ("grad", "both"):
                    loss = loss * nan
            return loss, targets, report

        def evaluate(self):
            metrics = super().evaluate()
            if metrics is not None:
                append("eval", {"iteration": self.state.iteration, **metrics,
                                "consumed_valid": self.state.consumed_valid_samples})
            return metrics

    try:
        args = RunArguments.from_flags(**flags)
        trainer = RecordingTrainer(args)
        state = trainer.train()
        append("done", {"state": state.to_dict()})
        dist.barrier()
    except Exception as err:  # the test reads the message
        append("error", {"type": type(err).__name__, "message": str(err),
                         "traceback": traceback.format_exc()})
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)
    sys.stdout.flush()
    sys.stderr.flush()
    # End deliberately once everything is written: no process-group teardown, which under
    # gloo rarely aborts a process after its work is done (DESIGN.md).
    os._exit(0)


if __name__ == "__main__":
    main()
