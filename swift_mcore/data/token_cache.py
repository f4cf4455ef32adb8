"""Data tokenized once and cached by content: the embedded corpus, raw --dataset files, sft samples."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Callable, Optional, Sequence

import numpy as np

from . import corpus, indexed
from ..atomic_write import write_atomic
from ..cache import cache_dir, locked
from ..errors import ArgumentError

logger = logging.getLogger("swift_mcore")


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


# ---- sft conversations: every sample tokenized once, memory-mapped ----------------------

SFT_SCHEMA = {"ids": ("int32", 1), "targets": ("bool", 1), "offsets": ("int64", 1),
              "answers": ("int64", 1)}
# Conversations per task sent to a worker: the same chunks whatever the worker count.
SFT_CHUNK = 256
# Checking every token id of a large cache at each start would read it all; windows this
# large catch ids of another vocabulary (they are spread everywhere).
ID_CHECK_BYTES = 64 << 20


def sft_token_identity(sources_fingerprint: str, tokenizer, template, loss_on: str,
                       columns) -> dict:
    """What decides the tokens of every sample: the files' content, the tokenizer, the
    template (its Jinja text when it is the tokenizer's) and the flags that change a
    sample's tokens or targets. --seq_length, --truncation_strategy and --packing are not
    part of it: they are applied to the stored samples at each start."""
    from .sft_samples import ENCODING_VERSION

    shape = template.identity()
    return {"what": "sft samples", "version": ENCODING_VERSION,
            "sources": sources_fingerprint, "tokenizer": tokenizer.fingerprint,
            "template": shape.pop("name"), **shape, "loss_on": loss_on,
            "columns": sorted([k, v] for k, v in columns.items())}


# identity field -> how a user names it (a --cached_dataset made with other flags)
IDENTITY_FLAGS = {
    "version": "swift-mcore's encoding version", "tokenizer": "the tokenizer (--tokenizer or "
    "--model)", "template": "--template", "system": "--system",
    "train_separator": "--train_separator", "ignore_empty_think": "--ignore_empty_think",
    "chat_template": "the tokenizer's chat template", "loss_on": "--loss_on",
    "columns": "--columns", "what": "the kind of data"}


def _sft_build(sources, columns, flag: str, template, loss_on: str, num_proc: int,
               identity: dict):
    def build(job) -> dict:
        from .conversations import read_conversations

        conversations = read_conversations(sources, columns, flag)
        split = _write_sft_tokens(conversations, template, loss_on, num_proc, job)
        return {"conversations": len(conversations), "split": split, "identity": identity,
                "sources": [s.path for s in sources]}

    return build


def _tokenized(arrays, meta):
    from .sft_samples import Encoded, Tokenized

    offsets = arrays["offsets"]
    encoded = Encoded(arrays["ids"], arrays["targets"], np.asarray(offsets[:-1]),
                      np.asarray(offsets[1:]))
    return Tokenized(encoded, np.asarray(arrays["answers"]), int(meta["conversations"]),
                     int(meta["split"]))


def cached_sft_tokens(sources, columns, flag: str, template, loss_on: str,
                      num_proc: int = 1, on_event=lambda event: None):
    """The samples of ``sources`` tokenized (sft_samples.Tokenized), from the cache or built
    into it once (``num_proc`` worker processes, a progress bar on a terminal)."""
    from .array_cache import cached_arrays
    from .sources import content_fingerprint

    identity = sft_token_identity(content_fingerprint(sources), template.tokenizer, template,
                                  loss_on, columns)
    vocab = template.tokenizer.vocab_size
    arrays, meta = cached_arrays(
        "sft", json.dumps(identity, sort_keys=True), SFT_SCHEMA,
        _sft_build(sources, columns, flag, template, loss_on, num_proc, identity),
        check=lambda a, m: _check_sft_arrays(a, m, vocab), on_event=on_event)
    return _tokenized(arrays, meta)


def write_sft_dataset(folder: str, sources, columns, template, loss_on: str,
                      num_proc: int = 1) -> dict:
    """The samples of ``sources`` written to ``folder`` (which must not exist), in the token
    cache's format: what `swift-mcore preprocess sft` writes and --cached_dataset reads."""
    from .array_cache import build_folder
    from .sources import content_fingerprint

    identity = sft_token_identity(content_fingerprint(sources), template.tokenizer, template,
                                  loss_on, columns)
    build_folder(folder, json.dumps(identity, sort_keys=True), SFT_SCHEMA,
                 _sft_build(sources, columns, "--dataset", template, loss_on, num_proc,
                            identity))
    return identity


def load_sft_dataset(folder: str, template, loss_on: str, columns,
                     flag: str = "--cached_dataset"):
    """(Tokenized, identity) of a folder written by `swift-mcore preprocess sft`. Raises
    ArgumentError for a folder that is not one, or was made with another tokenizer,
    template or flag than this run's (naming it)."""
    vocab = template.tokenizer.vocab_size
    arrays, meta, theirs = load_prepared(
        folder, flag, "a dataset", SFT_SCHEMA, lambda a, m: _check_sft_arrays(a, m, vocab),
        lambda sources: sft_token_identity(sources, template.tokenizer, template, loss_on,
                                           columns), IDENTITY_FLAGS)
    return _tokenized(arrays, meta), theirs


def load_prepared(folder: str, flag: str, what: str, schema: dict, check,
                  identity: Callable[[str], dict], flags: dict):
    """(arrays, meta, identity) of a folder `swift-mcore preprocess sft` wrote (``what``:
    the kind of dataset it must be). ArgumentError naming ``flag`` and the folder for one
    that is not one, or whose identity differs from this run's ``identity(sources)`` (the
    field named as ``flags`` says)."""
    from .array_cache import CacheInvalid, load_arrays

    try:
        arrays, meta = load_arrays(folder, None, schema, check=check)
    except CacheInvalid as err:
        raise ArgumentError(f"{flag} {folder}: not {what} written by `swift-mcore "
                            f"preprocess sft` ({err})") from None
    theirs = meta.get("identity")
    if not isinstance(theirs, dict) or not isinstance(theirs.get("sources"), str):
        raise ArgumentError(f"{flag} {folder}: its manifest does not say how it was made")
    ours = identity(theirs["sources"])
    for field in ours:
        if ours[field] != theirs.get(field):
            raise ArgumentError(
                f"{flag} {folder}: was prepared with {flags.get(field, field)} "
                f"{_short(theirs.get(field))}, this run has {_short(ours[field])}; give the "
                f"flags `swift-mcore preprocess sft` had, or train from the files with "
                f"--dataset")
    return arrays, meta, theirs


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_sft_arrays(arrays, meta, vocab_size: int) -> None:
    """Raises ValueError unless the arrays are a consistent set of samples."""
    ids, targets, offsets, answers = (arrays[n] for n in ("ids", "targets", "offsets",
                                                           "answers"))
    for name in ("conversations", "split"):
        if not isinstance(meta.get(name), int) or isinstance(meta[name], bool) or \
                meta[name] < 0:
            raise ValueError(f"the manifest's {name} is not a count")
    if len(targets) != len(ids) or len(offsets) != len(answers) + 1:
        raise ValueError("its arrays disagree in length")
    if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != len(ids) or \
            (np.diff(offsets) < 0).any():
        raise ValueError("its sample offsets are out of order")
    if (answers < 0).any():
        raise ValueError("its answer counts are negative")
    # each conversation gives one sample or more; the counts are what the run reports
    if meta["conversations"] > len(answers) or meta["split"] > meta["conversations"]:
        raise ValueError(f"the manifest's counts ({meta['conversations']} conversations, "
                         f"{meta['split']} split) do not fit its {len(answers)} samples")
    check_token_ids(ids, vocab_size)
    check_answer_counts(targets, offsets, answers)


def check_answer_counts(targets: np.ndarray, offsets: np.ndarray, answers: np.ndarray) -> None:
    """Raises ValueError unless each sample's answer count is its trained tokens after the
    first (which samples train, and fit() keeps or drops by it): every sample of a cache of
    up to ID_CHECK_BYTES of targets, else 16 evenly spaced windows of samples."""
    n = len(answers)
    if not n:
        return
    if targets.nbytes <= ID_CHECK_BYTES:
        windows = [(0, n)]
    else:
        size = max(1, int(n * ID_CHECK_BYTES // targets.nbytes // 16))
        windows = [(int(a), int(a) + size) for a in np.unique(
            np.linspace(0, n - size, 16).astype(np.int64))]
    for a, b in windows:
        lo = int(offsets[a])
        span = np.asarray(targets[lo:int(offsets[b])]).view(np.uint8)
        starts, ends = offsets[a:b] - lo, offsets[a + 1:b + 1] - lo
        counts = np.zeros(b - a, np.int64)
        full = ends > starts
        if full.any():
            # each sample's targets summed (no empty sample lies between two starts), less
            # its first token's
            first = starts[full]
            counts[full] = np.add.reduceat(span, first, dtype=np.int64) - span[first]
        wrong = np.flatnonzero(counts != answers[a:b])
        if len(wrong):
            k = a + int(wrong[0])
            raise ValueError(f"sample {k}'s answer count ({int(answers[k])}) is not its "
                             f"trained tokens ({int(counts[wrong[0]])})")


def check_token_ids(ids: np.ndarray, vocab_size: int) -> None:
    """Raises ValueError for ids outside the vocabulary (sampled windows of a large array)."""
    if len(ids):
        if ids.nbytes <= ID_CHECK_BYTES:
            parts = [ids]
        else:
            window = ID_CHECK_BYTES // 16 // ids.itemsize
            parts = [ids[s:s + window] for s in np.linspace(0, len(ids) - window, 16
                                                            ).astype(np.int64)]
        if any(p.min() < 0 or p.max() >= vocab_size for p in parts):
            raise ValueError(f"it holds token ids outside the vocabulary (0..{vocab_size - 1})")


_sft_worker: dict = {}


def _init_sft_worker(template, loss_on: str) -> None:
    _sft_worker.update(template=template, loss_on=loss_on)


def _encode_sft_chunk(conversations):
    from .sft_samples import encode_chunk

    return encode_chunk(conversations, _sft_worker["template"], _sft_worker["loss_on"])


def _write_sft_tokens(conversations, template, loss_on: str, num_proc: int, job) -> int:
    """Encodes ``conversations`` in chunks (in this process, or in ``num_proc`` forked
    workers, results taken in order) into the build's arrays; returns the split count."""
    from .sft_samples import encode_chunk
    from .worker_pool import forked_pool, in_order

    chunks = (conversations[i:i + SFT_CHUNK] for i in range(0, len(conversations), SFT_CHUNK))
    ids, targets, offsets, answers = (job.writer(n) for n in ("ids", "targets", "offsets",
                                                               "answers"))
    offsets.append(np.zeros(1, np.int64))
    state = {"end": 0, "split": 0}

    def add(result) -> None:
        chunk_ids, chunk_targets, lengths, chunk_answers, split = result
        ids.append(chunk_ids)
        targets.append(chunk_targets)
        offsets.append(state["end"] + np.cumsum(lengths))
        state["end"] += int(lengths.sum())
        answers.append(chunk_answers)
        state["split"] += split

    bar = _progress(len(conversations))
    try:
        if num_proc <= 1:
            for chunk in chunks:
                add(encode_chunk(chunk, template, loss_on))
                bar.update(len(chunk))
            return state["split"]
        with forked_pool(num_proc, _init_sft_worker, (template, loss_on)) as pool:
            sized = ((len(chunk), chunk) for chunk in chunks)
            for n, result in in_order(pool, _encode_sft_chunk, sized, num_proc):
                add(result)
                bar.update(n)
        return state["split"]
    finally:
        bar.close()


def _progress(total: int):
    """A tqdm bar on a terminal (silent in logs and tests)."""
    from tqdm import tqdm

    return tqdm(total=total, desc="tokenizing conversations", unit="conv", disable=None,
                leave=False)


# ---- packing plans: the rows of a packed dataset, an index over its samples ----------------

PACK_SCHEMA = {"members": ("int64", 1), "row_offsets": ("int64", 1)}


def _pack_key(positions: np.ndarray, capacity: int) -> str:
    return json.dumps({"what": "sft packing", "version": 1, "capacity": int(capacity),
                       "positions": hashlib.sha256(positions.tobytes()).hexdigest()})


def _pack_build(positions: np.ndarray, capacity: int):
    from .packing import pack

    def build(job) -> dict:
        rows = pack(positions, capacity)
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(r) for r in rows])
        job.writer("members").append(np.fromiter((k for row in rows for k in row), np.int64,
                                                 count=int(offsets[-1])))
        job.writer("row_offsets").append(offsets)
        return {"rows": len(rows)}

    return build


def _pack_check(positions: np.ndarray, capacity: int):
    def check(arrays, meta) -> None:
        members, offsets = arrays["members"], arrays["row_offsets"]
        if len(members) != len(positions) or not np.array_equal(
                np.sort(members), np.arange(len(positions))):
            raise ValueError("its rows do not hold every sample once")
        if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != len(members) or \
                (np.diff(offsets) <= 0).any():
            raise ValueError("its row offsets are out of order")
        used = np.add.reduceat(positions[members], offsets[:-1])
        if (used > capacity).any():
            raise ValueError(f"a row holds more than {capacity} positions")

    return check


def cached_pack_plan(positions: np.ndarray, capacity: int, on_event=lambda event: None):
    """(members, row_offsets) of packing.pack(positions, capacity), cached by the positions'
    content and the capacity: a pure function of them, planned once (seconds per million
    samples) and mapped by later starts and the other ranks."""
    from .array_cache import cached_arrays

    positions = np.ascontiguousarray(positions, dtype=np.int64)
    arrays, _ = cached_arrays("sft-packing", _pack_key(positions, capacity), PACK_SCHEMA,
                              _pack_build(positions, capacity),
                              check=_pack_check(positions, capacity), on_event=on_event)
    return arrays["members"], arrays["row_offsets"]


# A prepared folder's packing plans: FOLDER/packing/<sha256 of the plan's key>/, an index
# (members, row offsets) over the folder's samples for one --seq_length and truncation.
PLANS = "packing"


def _plan_folder(folder: str, positions: np.ndarray, capacity: int) -> str:
    key = _pack_key(positions, capacity)
    return os.path.join(folder, PLANS, hashlib.sha256(key.encode()).hexdigest()[:24])


def write_pack_plan(folder: str, positions: np.ndarray, capacity: int) -> int:
    """The packing plan of ``positions`` stored in the prepared ``folder``; returns its
    row count."""
    from .array_cache import build_folder, load_arrays

    positions = np.ascontiguousarray(positions, dtype=np.int64)
    plan = _plan_folder(folder, positions, capacity)
    os.makedirs(os.path.dirname(plan), exist_ok=True)
    key = _pack_key(positions, capacity)
    build_folder(plan, key, PACK_SCHEMA, _pack_build(positions, capacity))
    arrays, _ = load_arrays(plan, key, PACK_SCHEMA, check=_pack_check(positions, capacity))
    return len(arrays["row_offsets"]) - 1


def pack_plan(positions: np.ndarray, capacity: int, prepared: Optional[str] = None,
              on_event=lambda event: None):
    """(members, row_offsets): the plan stored in the ``prepared`` folder when it has one
    for these samples and capacity (``on_event("stored")``), else ``cached_pack_plan``
    (re-planned from the samples' lengths; no token is encoded either way)."""
    from .array_cache import CacheInvalid, load_arrays

    positions = np.ascontiguousarray(positions, dtype=np.int64)
    if prepared:
        plan = _plan_folder(prepared, positions, capacity)
        if os.path.lexists(plan):
            try:
                arrays, _ = load_arrays(plan, _pack_key(positions, capacity), PACK_SCHEMA,
                                        check=_pack_check(positions, capacity))
                on_event("stored")
                return arrays["members"], arrays["row_offsets"]
            except CacheInvalid as err:
                logger.warning("warning: %s: %s; planning the packing again", plan, err)
    return cached_pack_plan(positions, capacity, on_event)
