"""Data tokenized on demand and cached by content: the embedded corpus, and --dataset raw files."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, Sequence

from . import corpus, indexed
from ..atomic_write import write_atomic
from ..cache import cache_dir, locked


def cached_prefix(kind: str, key: str, name: str, build: Callable[[str], dict]) -> str:
    """The prefix for ``key`` under the cache, built once by ``build(prefix) -> counts``.

    Concurrent callers (every rank of a run) wait on a lock and then find the files. A build
    that fails leaves nothing behind, so the next start tries again.
    """
    folder = cache_dir(kind, hashlib.sha256(key.encode()).hexdigest()[:20])
    prefix = os.path.join(folder, name)
    if not indexed.exists(prefix):
        with locked(folder):
            if not indexed.exists(prefix):
                stats = build(prefix)
                write_atomic(os.path.join(folder, "info.json"),
                             json.dumps({"key": key, **stats}, indent=1))
    return prefix


def default_corpus_prefix(tokenizer) -> str:
    """The embedded corpus tokenized with ``tokenizer``, cached by (corpus, tokenizer)."""
    key = f"stdlib corpus={corpus.fingerprint()} tokenizer={tokenizer.fingerprint}"
    return cached_prefix("corpus", key, "stdlib",
                         lambda prefix: indexed.write_indexed(corpus.iter_documents(),
                                                              tokenizer, prefix))


def raw_files_prefix(sources: Sequence, text_key: str, tokenizer) -> str:
    """--dataset inputs tokenized into one cached prefix, keyed by their content (not their
    paths or timestamps), the text column and the tokenizer.

    Tokenized in this process (the tokenizer's own threads use the cores): a training
    process holds threads of its own (gloo, pyarrow) that make forking workers unsafe.
    """
    from .encoding import encode_sources
    from .sources import content_fingerprint

    key = (f"raw sources={content_fingerprint(sources)} text_key={text_key} "
           f"tokenizer={tokenizer.fingerprint} eod=1")

    def build(prefix: str) -> dict:
        stats = encode_sources(sources, text_key, tokenizer, prefix, workers=1,
                               append_eod=True, flag="--dataset")
        return {**stats.as_dict(), "sources": [s.path for s in sources]}

    return cached_prefix("datasets", key, "data", build)
