"""Forked tokenizing workers whose results come back in input order, a bounded number in flight."""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import os
import signal
from typing import Callable, Iterable, Iterator, Tuple

# Tasks in flight per worker; bounds memory (the reader would otherwise run ahead of the
# tokenizers and hold the whole corpus) while keeping every worker busy.
TASKS_PER_WORKER = 3


@contextlib.contextmanager
def forked_pool(workers: int, initializer: Callable, initargs: tuple):
    """A pool of ``workers`` processes. fork: the workers inherit the loaded tokenizer (a
    Hugging Face tokenizer takes seconds to load) instead of unpickling it; spawn where fork
    does not exist. Each worker tokenizes on one core: the tokenizers library's own thread
    pool would fight the other workers. The variable is set before the fork (so the library
    does not warn in each child that a parent's thread pool was forked) and given back after."""
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    pool = ctx.Pool(workers, initializer=_single_threaded(initializer), initargs=initargs)
    try:
        yield pool
    finally:
        pool.terminate()
        pool.join()
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


class _single_threaded:
    """The worker's initializer, run after pinning the tokenizers library to one thread and
    giving the stop signals their default actions (a class, not a closure, so that spawn can
    pickle it)."""

    def __init__(self, initializer: Callable):
        self.initializer = initializer

    def __call__(self, *initargs) -> None:
        # The pool ends its workers with SIGTERM (terminate): a handler inherited from the
        # parent (a Trainer's, in a process that trained before) would leave them waiting
        # on the task queue and the parent's join hanging.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self.initializer(*initargs)


def in_order(pool, func: Callable, tasks: Iterable[Tuple[object, object]], workers: int
             ) -> Iterator[Tuple[object, object]]:
    """(tag, func(arg)) for each (tag, arg) of ``tasks``, in input order, computed by
    ``pool``; at most ``workers * TASKS_PER_WORKER`` tasks are read ahead."""
    pending: collections.deque = collections.deque()
    for tag, arg in tasks:
        pending.append((tag, pool.apply_async(func, (arg,))))
        if len(pending) >= workers * TASKS_PER_WORKER:
            tag, result = pending.popleft()
            yield tag, result.get()
    while pending:
        tag, result = pending.popleft()
        yield tag, result.get()
