"""The progress watchdog: a rank whose iteration (step, evaluation, save) takes longer than
--distributed_timeout_minutes prints which iteration and rank stalled and the Python stacks
of all its threads (faulthandler), then ends, so that torchrun can restart the group.

A stuck collective ends on its own after the same timeout (the process group's); a rank
stalled outside any collective (a hung file system, a deadlock, a stopped process) would
not: the others would wait in their next collective, time out and end, and the stalled one
would live on. The watchdog ends it too, and its stacks say where it was. A Python thread
checks the deadline; faulthandler's own timer (C, no GIL needed) is the backstop for a rank
stuck while holding the GIL.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from typing import Optional

EXIT_CODE = 124  # like timeout(1): the rank ended for lack of progress


class Watchdog:
    def __init__(self, timeout_s: float, rank: int):
        self.timeout_s, self.rank = timeout_s, rank
        self._lock = threading.Lock()
        self._deadline: Optional[float] = None
        self._what = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="swift-mcore-watchdog",
                                        daemon=True)
        self._thread.start()

    def arm(self, what: str) -> None:
        """Progress: ``what`` (e.g. "iteration 7") must finish within the timeout."""
        with self._lock:
            self._deadline = time.monotonic() + self.timeout_s
            self._what = what
        # The backstop fires a little later, so that the Python thread speaks first.
        faulthandler.dump_traceback_later(self.timeout_s + max(5.0, 0.2 * self.timeout_s),
                                          exit=True, file=_stack_file())

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None
        faulthandler.cancel_dump_traceback_later()

    def close(self) -> None:
        self.disarm()
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 10)):
            with self._lock:
                late = self._deadline is not None and time.monotonic() > self._deadline
                what = self._what
            if late:
                self._fire(what)

    def _fire(self, what: str) -> None:
        minutes = self.timeout_s / 60
        print(f"swift-mcore: rank {self.rank} made no progress in {what} for "
              f"{self.timeout_s:.0f} s (--distributed_timeout_minutes {minutes:g}); its "
              f"Python stacks follow, then it ends (exit {EXIT_CODE}) so that torchrun can "
              f"restart the group", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=_stack_file(), all_threads=True)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(EXIT_CODE)


def _stack_file():
    """Where faulthandler writes the stacks: stderr, or the process's own stderr where
    sys.stderr has no file descriptor (a notebook, pytest's capture of a Trainer run)."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return sys.__stderr__
