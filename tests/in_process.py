"""Runs `swift-mcore pt`, `sft` or `rlhf` on one rank in the test's own process (no start-up cost)."""

import contextlib
import io
import signal
from types import SimpleNamespace

from run_helpers import TINY


def train_in_process(output_dir, *flags, command: str = "sft", base=TINY,
                     trainer=None) -> SimpleNamespace:
    """What `swift-mcore sft|pt BASE... --output_dir DIR FLAGS` does on one rank (parse,
    resolve, Trainer.train; ``trainer``: a Trainer subclass instead), on the one-rank gloo
    group the caller holds (conftest.gloo_group); returns its stdout as ``.stdout``, like
    subprocess.run. For runs whose process is not what a test checks: a resume that is
    checked for exactness starts a real process (state left in this one could hide what a
    checkpoint lacks). The signal handlers a Trainer installs are put back afterwards."""
    from swift_mcore.arguments import RlhfArguments, RunArguments, SftArguments, parse_args
    from swift_mcore.run_config import resolve
    from swift_mcore.training.trainer import Trainer

    cls = {"sft": SftArguments, "rlhf": RlhfArguments}.get(command, RunArguments)
    argv = [*base, "--output_dir", str(output_dir), *map(str, flags)]
    config = resolve(parse_args(argv, prog=f"swift-mcore {command}", cls=cls), world_size=1)
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            (trainer or Trainer)(config).train()
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    return SimpleNamespace(stdout=out.getvalue())
