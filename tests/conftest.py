"""Shared fixtures: an isolated cache, and a one-rank gloo group for in-process tests."""

import os
import pathlib

import pytest

from run_helpers import free_port

TESTS = pathlib.Path(__file__).parent

# scripts/test.sh runs the suite on two pytest-xdist workers. A worker takes one file at a
# time (its module fixtures are built once), or one of these groups of files, which share a
# session fixture of tests/checkpointing/conftest.py (built once per worker).
SHARED_RUNS = {
    "tests/checkpointing/test_async_save.py": "straight one-rank run",
    "tests/checkpointing/test_resume_signals.py": "straight one-rank run",
    "tests/checkpointing/test_resume_recompute.py": "straight one-rank run",
    "tests/checkpointing/test_elastic.py": "straight two-rank run",
    "tests/checkpointing/test_resume_exact.py": "straight two-rank run",
    "tests/checkpointing/test_resume_disk_full.py": "straight cli run",
    "tests/checkpointing/test_run_lock.py": "straight cli run",
}


def work_unit(nodeid: str) -> str:
    """What one worker runs together: a file, or its SHARED_RUNS group."""
    path = nodeid.split("::", 1)[0]
    return SHARED_RUNS.get(path, path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return work_unit(nodeid)

    return WorkUnits(config, log)


def pytest_collection_modifyitems(config, items):
    # The units with the most multi-process tests (marked slow) first, each in its own
    # order: the workers then end close together instead of one waiting on a long unit.
    slow, first_seen = {}, {}
    for item in items:
        unit = work_unit(item.nodeid)
        slow[unit] = slow.get(unit, 0) + (item.get_closest_marker("slow") is not None)
        first_seen.setdefault(unit, len(first_seen))
    items.sort(key=lambda it: (-slow[work_unit(it.nodeid)], first_seen[work_unit(it.nodeid)]))


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    # Tokenizers and tokenized corpora are cached; tests share one cache of their own.
    if "SWIFT_MCORE_CACHE" not in os.environ:
        os.environ["SWIFT_MCORE_CACHE"] = str(tmp_path_factory.mktemp("swift_mcore_cache"))
    yield


@pytest.fixture(scope="module")
def gloo_group():
    """A one-rank gloo process group with megatron's parallel state (TP=PP=1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from swift_mcore.runtime.cpu import cpu_compat, onednn_linear

    cpu_compat.activate()
    # Models built here multiply on megatron's own torch.matmul; a run through the Trainer
    # sets --cpu_matmul's choice itself (distributed.initialize), which then stays in force.
    onednn_linear.enable(False)
    created = not dist.is_initialized()
    # Put MASTER_ADDR/PORT back afterwards: subprocesses started later inherit os.environ,
    # and a one-rank run would then try to bind this port, which may still be held here.
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    if created:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    if parallel_state.model_parallel_is_initialized():  # left by an in-process command
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
