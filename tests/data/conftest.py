"""Data-test fixtures: a fresh cache per test, the session's default tokenizer, small corpora."""

import pytest

from data_helpers import make_documents


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty SWIFT_MCORE_CACHE, for tests that watch what gets built and cached."""
    path = tmp_path / "cache"
    monkeypatch.setenv("SWIFT_MCORE_CACHE", str(path))
    return path


@pytest.fixture(scope="session")
def tokenizer():
    """The default tokenizer from the session cache (trained once, about a second)."""
    from swift_mcore.data.tokenizer import default_tokenizer

    return default_tokenizer()


@pytest.fixture(scope="session")
def small_prefixes(tmp_path_factory, tokenizer):
    """Two generated prefixes of clearly different sizes; with the default split 949,50,1
    only b has a test document."""
    from swift_mcore.data.indexed import write_indexed

    folder = tmp_path_factory.mktemp("small_corpora")
    prefixes = {}
    for name, n_docs, seed in (("a", 120, 1), ("b", 700, 2)):
        prefixes[name] = str(folder / name)
        write_indexed(make_documents(n_docs, seed), tokenizer, prefixes[name])
    return prefixes
