"""--profile: torch's profiler over a window of iterations on chosen ranks, its trace (and on
CUDA, with --record_memory_history, a memory snapshot) written under output_dir/profile."""

from __future__ import annotations

import os
from typing import Callable, Optional

from ..atomic_write import temp_name
from ..errors import OutputError

FOLDER = "profile"


def trace_path(output_dir: str, rank: int) -> str:
    return os.path.join(output_dir, FOLDER, f"rank_{rank}.pt.trace.json")


def memory_path(output_dir: str, rank: int) -> str:
    return os.path.join(output_dir, FOLDER, f"rank_{rank}_memory.pickle")


class StepProfiler:
    """Starts before iteration ``profile_step_start`` and stops after ``profile_step_end``
    (or when training ends inside the window), on the ranks of ``--profile_ranks`` only.
    The trainer calls ``before_step(n)`` before iteration n and ``after_step(n)`` after it."""

    def __init__(self, config, rank: int, log: Callable[[str], None] = print):
        lg = config.logging
        self.active = lg.profile and rank in lg.profile_ranks
        self.first, self.last = lg.profile_step_start, lg.profile_step_end
        self.cuda, self.rank, self.log = config.cuda, rank, log
        self.memory = lg.record_memory_history and config.cuda
        self.output_dir = lg.output_dir
        self.profiler = None

    @classmethod
    def for_config(cls, config, rank: int, log: Callable[[str], None] = print
                   ) -> Optional["StepProfiler"]:
        profiler = cls(config, rank, log)
        return profiler if profiler.active else None

    @staticmethod
    def check_folder(config) -> None:
        """Before any work: under --profile, output_dir/profile is absent or a real folder
        (a link planted at its name, or a file, is refused with OutputError)."""
        if config.logging.profile:
            _refuse_unless_folder(os.path.join(config.logging.output_dir, FOLDER),
                                  missing_ok=True)

    def before_step(self, iteration: int) -> None:
        if self.profiler is not None or not self.first <= iteration <= self.last:
            return
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self.profiler.start()
        self.started = iteration

    def after_step(self, iteration: int) -> None:
        if self.profiler is not None and iteration >= self.last:
            self.close(iteration)

    def close(self, iteration: Optional[int] = None) -> None:
        """Stops a running profiler and writes what it recorded (also when training ended
        inside the window)."""
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        folder = os.path.join(self.output_dir, FOLDER)
        _make_folder(folder)
        path = trace_path(self.output_dir, self.rank)
        _write_by_rename(path, profiler.export_chrome_trace)
        written = [path]
        if self.memory:
            import torch

            memory = memory_path(self.output_dir, self.rank)
            _write_by_rename(memory, torch.cuda.memory._dump_snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(memory)
        span = f"{self.started}-{iteration}" if iteration else f"{self.started}-"
        self.log(f"profile of iterations {span} (rank {self.rank}): {', '.join(written)}")


def _make_folder(folder: str) -> None:
    """output_dir/profile, a real folder (a link planted at its name is refused)."""
    try:
        os.mkdir(folder)
    except FileExistsError:
        pass
    _refuse_unless_folder(folder)


def _refuse_unless_folder(folder: str, missing_ok: bool = False) -> None:
    if missing_ok and not os.path.lexists(folder):
        return
    if os.path.islink(folder) or not os.path.isdir(folder):
        raise OutputError(f"--profile: {folder} is not a folder swift-mcore can write its "
                          f"trace into (a link or a file is there); remove it")


def _write_by_rename(path: str, write: Callable[[str], None]) -> None:
    """torch writes the file at a fresh temporary name; it then takes ``path``'s place (a
    link planted at ``path`` is replaced, never followed)."""
    tmp = temp_name(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)
