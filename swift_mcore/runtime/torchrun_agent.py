"""torchrun's agent as swift-mcore runs it: ranks stopped by a signal finish their save, and
the end of a run that did not succeed is one line (docs/launch.md).

`python -m swift_mcore.runtime.torchrun_agent <torchrun's arguments>` is torchrun itself
(torch.distributed.run's parser and launcher), with three differences:

- a stop signal (SIGTERM or SIGINT) is forwarded to the ranks once, and the agent then
  waits for them as long as they take: torchrun's own agent SIGKILLs them after
  its shutdown timeout (30 s; TORCH_ELASTIC_SHUTDOWN_TIMEOUT), in the middle of a save that
  takes longer. The scheduler's grace period (Slurm's KillWait, Kubernetes'
  terminationGracePeriodSeconds) is the bound. A second SIGINT is forwarded too (a rank
  interrupts at once on it); more SIGTERMs change nothing;
- the run stopped that way exits with the ranks' code (0 when each saved and exited 0), and
  says so in one line instead of torchrun's SignalException traceback;
- a failed rank is one line (which rank, its exit code or signal, where its error is)
  instead of torchrun's ChildFailedError traceback, and the exit code is the rank's.

Everything else (restarts, rendezvous, a failed attempt's 30 s shutdown) is torchrun's.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Dict, List, Optional

# "As long as they take": torch's shutdown takes a number of seconds (a year here).
WAIT_FOR_THE_RANKS = 365 * 24 * 3600


def exit_code(returncode: Optional[int]) -> int:
    """A process's status as a shell reports it: -N (killed by signal N) is 128 + N."""
    if returncode is None:
        return 1
    return 128 - returncode if returncode < 0 else returncode


def describe(returncode: Optional[int]) -> str:
    if returncode is not None and returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def stopped_line(sigval: int, codes: Dict[int, Optional[int]]) -> tuple:
    """The line and exit code of a run a stop signal ended; ``codes``: each global rank's
    exit status."""
    name = signal.Signals(sigval).name
    if not codes:
        return f"swift-mcore: stopped by {name} before the ranks started", 128 + sigval
    failed = {rank: code for rank, code in sorted(codes.items()) if code != 0}
    if not failed:
        return (f"swift-mcore: stopped by {name}: the {len(codes)} ranks finished and exited "
                f"0", 0)
    # A rank that exited with a code of its own says why the run stopped (a rank that ends
    # the job, runtime/elastic.py, exits 2 on refused flags); one the stop killed does not.
    rank, code = min(failed.items(), key=lambda item: (item[1] == -sigval, item[0]))
    return (f"swift-mcore: stopped by {name}: rank {rank} {describe(code)} "
            f"(its output is above)", exit_code(code))


def failed_line(failures: dict) -> tuple:
    """The line and exit code of a run whose ranks failed (torch's ProcessFailure of each
    failed global rank): the first to fail is named, its code is the run's."""
    rank, failure = min(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    where = "its error is above"
    if failure.error_file and os.path.isfile(failure.error_file):
        where = f"its error is above and in {failure.error_file}"
    return (f"swift-mcore: rank {rank} {describe(failure.exitcode)} ({where}); failed "
            f"ranks: {', '.join(map(str, sorted(failures)))}", exit_code(failure.exitcode))


def agent_class():
    """torch's LocalElasticAgent, waiting for the ranks when a stop signal ends the run and
    keeping their exit codes."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException

    class StopWaitingAgent(LocalElasticAgent):
        last = None  # the agent of this process (launch_agent builds one)
        stop_signal: Optional[int] = None
        exit_codes: Dict[int, Optional[int]] = {}

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            type(self).last = self

        def _invoke_run(self, role):
            try:
                return super()._invoke_run(role)
            except SignalException as err:
                self.stop_signal = err.sigval  # before run() shuts the ranks down
                raise

        def _shutdown(self, death_sig=signal.SIGTERM, timeout=30):
            if self.stop_signal is None:  # a finished run, or a failed attempt's restart
                super()._shutdown(death_sig, timeout)
            else:
                previous = {sig: signal.signal(sig, self._while_stopping)
                            for sig in (signal.SIGTERM, signal.SIGINT)}
                try:
                    super()._shutdown(self.stop_signal, WAIT_FOR_THE_RANKS)
                finally:
                    for sig, handler in previous.items():
                        signal.signal(sig, handler)
            handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
            self.exit_codes = {
                worker.global_rank: handlers[worker.local_rank].proc.returncode
                for worker in self._worker_group.workers if worker.local_rank in handlers}

        def _while_stopping(self, signum, frame):
            # The ranks have the stop already: a second SIGINT interrupts them at once
            # (the trainer's handler); another SIGTERM changes nothing.
            if signum == signal.SIGINT:
                for handler in (getattr(self._pcontext, "subprocess_handlers", None)
                                or {}).values():
                    if handler.proc.poll() is None:
                        try:
                            os.killpg(handler.proc.pid, signal.SIGINT)
                        except ProcessLookupError:
                            pass

    return StopWaitingAgent


def stop_with_the_launcher() -> None:
    """SIGTERM to this agent when the swift-mcore launcher that started it dies, however
    (SIGKILL too), so that the ranks stop and save instead of running on without it
    (Linux; the launcher names itself in SWIFT_MCORE_LAUNCHER_PID)."""
    launcher = os.environ.pop("SWIFT_MCORE_LAUNCHER_PID", None)
    if not launcher or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if str(os.getppid()) != launcher:  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: List[str]) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher import api as launcher

    args = torchrun.parse_args(argv)
    stop_with_the_launcher()
    agent = agent_class()
    # launch_agent builds its agent from this name (in this process only: it is the agent's)
    launcher.LocalElasticAgent = agent
    try:
        torchrun.run(args)
    except ChildFailedError as err:
        line, code = failed_line(err.failures)
        print(line, file=sys.stderr, flush=True)
        return code
    except SignalException as err:
        codes = agent.last.exit_codes if agent.last is not None else {}
        line, code = stopped_line(err.sigval, codes)
        print(line, file=sys.stderr, flush=True)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
