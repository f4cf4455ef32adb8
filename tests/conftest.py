"""Shared fixtures: an isolated cache, and a one-rank gloo group for in-process tests."""

import os

import pytest

from run_helpers import free_port


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

    from swift_mcore.runtime import cpu_compat

    cpu_compat.activate()
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
