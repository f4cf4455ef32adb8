"""torchrun's restarts seen from a rank: which attempt this is, the record of failed attempts,
and the stop of a run that fails the same way on every attempt.

torchrun (``--max-restarts N``) restarts every worker of the group when one fails; each
attempt resumes from the newest complete checkpoint (``--resume auto``). A failure that
repeats exactly (two attempts in a row that started from the same iteration and failed in
the same iteration with the same error) will repeat on every further attempt: the rank that
sees it says why and ends torchrun's agent, so that the job stops instead of spending its
restarts. Failures are recorded in ``output_dir/elastic_failures.jsonl``, one line per
failing rank and attempt, appended as a run file (run_files.py: never through a link).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from dataclasses import dataclass
from typing import Optional

from ..errors import OutputError
from . import run_files

FAILURES = run_files.ELASTIC_FAILURES


@dataclass(frozen=True)
class Attempt:
    restart: int        # TORCHELASTIC_RESTART_COUNT: 0 on the first attempt
    max_restarts: int   # TORCHELASTIC_MAX_RESTARTS

    def describe(self) -> str:
        return f"torchrun attempt {self.restart + 1} of {self.max_restarts + 1}"


def current() -> Optional[Attempt]:
    """The attempt, where torchrun started this process; None otherwise."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    try:
        return Attempt(int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
                       int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")))
    except ValueError:
        return None


def of_group(attempt: Optional[Attempt]) -> Optional[Attempt]:
    """The group's attempt (collective; every rank calls it once, after the process group
    is up): the highest restart count of its ranks. On several nodes only the agent whose
    worker failed counts a restart; the others restart their workers for the new rendezvous
    with their count unchanged, so one rank's own count can say 'attempt 1' on a restart."""
    if attempt is None:
        return None
    import torch

    from .collectives import all_reduce

    restart = all_reduce(torch.tensor([attempt.restart], dtype=torch.int64),
                         op=torch.distributed.ReduceOp.MAX)
    return Attempt(int(restart.item()), attempt.max_restarts)


def start_line(attempt: Attempt, iteration: int, resumed_from: Optional[str]) -> str:
    """The log line of an attempt's start: which attempt, and where it resumed."""
    where = (f"resumed from {resumed_from} (iteration {iteration})" if resumed_from
             else f"starting at iteration {iteration} (no checkpoint to resume)")
    return f"{attempt.describe()}: {where}"


def signature(err: BaseException) -> str:
    """The error's kind and first line, numbers left out (ports, pids, sizes differ between
    attempts that fail the same way)."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: " + re.sub(r"\d+", "#", lines[0][:300] if lines else "")


def record_failure(output_dir: str, attempt: Attempt, rank: int, started_at: Optional[int],
                   iteration: int, err: BaseException) -> Optional[str]:
    """Append this rank's failure; returns the reason to stop restarting when the previous
    attempt failed the same way (same start, same iteration, same error), else None."""
    record = {"attempt": attempt.restart, "rank": rank, "started_at": started_at,
              "iteration": iteration, "error": signature(err)}
    path = os.path.join(output_dir, FAILURES)
    previous = [r for r in read_failures(path) if r.get("attempt") == attempt.restart - 1]
    try:
        run_files.append_line(path, json.dumps(record) + "\n")
    except OutputError as err:  # the failure itself is what the rank reports
        print(f"swift-mcore: WARNING: {err}", file=sys.stderr, flush=True)
        return None
    same = [r for r in previous if started_at is not None
            and (r["started_at"], r["iteration"], r["error"]) == (
                started_at, iteration, record["error"])]
    if not same:
        return None
    return (f"attempts {attempt.restart} and {attempt.restart + 1} both resumed at iteration "
            f"{started_at} and failed in iteration {iteration} with {record['error']}; a "
            f"restart would fail the same way, so the run stops here (records: {path})")


def report_failure(output_dir: str, attempt: Attempt, rank: int, started_at: Optional[int],
                   iteration: int, err: BaseException) -> None:
    """A rank's failure under torchrun: said on stderr, recorded; one that repeats the
    previous attempt's exactly ends the job instead of restarting it."""
    print(f"swift-mcore: rank {rank} failed in iteration {iteration} "
          f"({attempt.describe()}): {signature(err)}", file=sys.stderr, flush=True)
    reason = record_failure(output_dir, attempt, rank, started_at, iteration, err)
    if reason:
        stop_restarts(reason)


def read_failures(path: str) -> list:
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line cut by a kill
    return out


def stop_restarts(reason: str) -> None:
    """Say why, then end torchrun's agent (this process's parent): torchrun restarts a
    worker on any exit code, but stops, and ends the job, on SIGTERM. The caller then exits
    with its own code, which swift-mcore's agent makes the job's."""
    print(f"swift-mcore: not restarting: {reason}", file=sys.stderr, flush=True)
    parent = os.getppid()
    if parent > 1 and _is_torchrun(parent):
        # The agent passes the stop on to every rank, this one included, which is on its way
        # out with its own exit code already: killed by that SIGTERM, it would end the job
        # with 143 ("rank 0 was killed by SIGTERM") instead of the code that says why.
        try:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        except ValueError:  # not the main thread: the stop may still kill this rank
            pass
        os.kill(parent, signal.SIGTERM)


# The agents a rank can be started by: torchrun's, and swift-mcore's (its launcher's).
AGENT_MODULES = ("torch.distributed.run", "swift_mcore.runtime.torchrun_agent")


def _is_torchrun(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmd = fh.read().decode("utf-8", "replace")
    except OSError:  # no /proc: believe the environment, set by torchrun only
        return "TORCHELASTIC_RUN_ID" in os.environ
    return is_agent_command(cmd.split("\0"))


def is_agent_command(argv: list) -> bool:
    """Whether a command line is a torchrun agent: ``python [options] -m <one of
    AGENT_MODULES>``, or torchrun's own script (``torchrun``, or ``python .../torchrun``).
    The module or program itself is read, not a substring of the whole line: a parent
    whose arguments merely mention torchrun (a wrapper script, an output folder) must not
    be sent the SIGTERM that ends a job."""
    if not argv or not argv[0]:
        return False
    if os.path.basename(argv[0]) == "torchrun":
        return True
    args = iter(argv[1:])
    for arg in args:
        if arg == "-m":
            return next(args, None) in AGENT_MODULES
        if arg.startswith("-m"):
            return arg[2:] in AGENT_MODULES
        if arg.startswith("-c"):
            return False
        if arg in ("-X", "-W"):  # options with a value of their own
            next(args, None)
        elif not arg.startswith("-"):  # the script the interpreter runs
            return os.path.basename(arg) == "torchrun"
    return False
