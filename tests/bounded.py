"""A deadline for a call made in the test's own process: a read that blocks (a FIFO opened
as a file) fails the test instead of hanging pytest, without a subprocess to kill."""

import contextlib
import faulthandler
import io
import signal
import time
from typing import Iterator, List, Tuple

import pytest

# A blocking open() returns EINTR to the SIGALRM below, whose handler fails the test. Code
# stuck where no Python handler runs (a C loop that retries) is stopped later by ending the
# process (pytest-xdist then reports the test as crashed).
HARD_STOP_AFTER = 60


@contextlib.contextmanager
def deadline(seconds: int, what: str) -> Iterator[None]:
    """Fails the test when the block still runs after ``seconds`` (main thread only)."""
    def expired(signum, frame):
        pytest.fail(f"{what} still ran after {seconds} s (blocked on a FIFO?)")

    previous = signal.signal(signal.SIGALRM, expired)
    faulthandler.dump_traceback_later(seconds + HARD_STOP_AFTER, exit=True)
    # an outer alarm (pytest-timeout's --timeout, the signal method) is put back after: the
    # rest of the test stays under it
    outer, start = signal.getitimer(signal.ITIMER_REAL)[0], time.monotonic()
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 1e-3))


def cli(*argv, seconds: int = 120) -> Tuple[int, List[str]]:
    """`swift-mcore ARGV` as the console script runs it (cli.main), in this process under
    ``deadline``: its exit code and the non-blank lines it wrote to stderr."""
    from swift_mcore.cli import main

    err = io.StringIO()
    with deadline(seconds, f"swift-mcore {argv[0]}"), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, [line for line in err.getvalue().splitlines() if line.strip()]
