"""Data: corpus, raw sources, tokenizers, megatron indexed datasets, the sampler, loaders."""

import importlib

# name -> submodule. Loaded on first use: the tokenizer and dataset modules import megatron-core
# (seconds), which the sampler and corpus do not need.
_EXPORTS = {
    "Tokenizer": "tokenizer", "build_tokenizer": "tokenizer", "load_tokenizer": "tokenizer",
    "default_tokenizer": "tokenizer",
    "write_indexed": "indexed", "check_indexed": "indexed",
    "default_corpus_prefix": "token_cache", "raw_files_prefix": "token_cache",
    "expand_inputs": "sources", "encode_sources": "encoding",
    "build_datasets": "gpt_datasets", "parse_blend": "gpt_datasets", "dataset_fingerprint": "gpt_datasets",
    "GlobalOrder": "sampler", "micro_batches": "sampler",
    "build_data_iterator": "loader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
