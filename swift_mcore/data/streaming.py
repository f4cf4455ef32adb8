"""Streaming sft data (--streaming): files read lazily, shuffled in a seeded buffer, encoded, packed, with an exact position.

The reading, the shuffle buffer, the position's frame and the per-rank iterator
(ShuffledRows, RowStream, _RankBatches, build_stream_iterator) serve pt's text stream too
(text_stream.py).

The stream is one global sequence of training rows, the same on every rank and for any
number of ranks: the files are read in order (epoch after epoch), each row read goes
through a shuffle buffer of --shuffle_buffer_size rows (a seeded draw picks the row to emit
and the row read next takes its slot), an emitted row is encoded into its samples (fitted
to --seq_length as the cached path fits them), and the samples become training rows one
each, or, with --packing, are packed best-fit into a few open rows (the fullest is emitted
when none has room). Global position ``p`` is the ``p``-th training row; iteration ``i``
trains positions ``[i*GBS, (i+1)*GBS)`` and data-parallel rank ``r`` its slice of them
(sampler.micro_batches), as for the map-style datasets.

The position is small and exact: where the reader is (epoch, file, row, byte offset), the
shuffle's generator state, and the locators (file, row, byte offset) of the rows held in
the buffer, in the open packed rows and in rows encoded but not yet trained. A resumed run
re-reads those few rows by their locators and continues with the very next training row;
nothing is replayed from the start and nothing is skipped. Each rank computes the whole
global stream (reading and encoding every row) and keeps its own slice: the position does
not depend on the number of ranks, so a run may resume on another data-parallel size.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..errors import ArgumentError, CheckpointError
from ..input_files import check_regular, loads
from .sources import SAVED, Source

# Part of the stream's identity: change it whenever the order or the rows a stream yields
# change for the same files and flags.
STREAM_VERSION = 1
# Packed rows kept open at once: a sample goes to the open row it fills best; with none
# with room left, the fullest row is emitted.
OPEN_ROWS = 8
# Rows a stream draws and tokenizes per call (sft and pt): one call for several rows costs
# less CPU than one per row (about 7% for conversations of a few hundred tokens), and the
# rows trained are the same for any count.
ENCODE_ROWS = 16
# Bytes hashed at each end of a file for its identity (with its size): a stream's files are
# too large to hash whole at every start.
EDGE_BYTES = 1 << 20

Locator = Tuple[int, int, int]  # (file index, row index in the file, byte offset)


def check_stream_sources(sources: Sequence[Source], flag: str = "--dataset") -> None:
    """--streaming reads JSON lines, Parquet and saved datasets folders (readable from any
    row without reading what comes before)."""
    for source in sources:
        suffix = os.path.splitext(source.path)[1].lower()
        if source.kind == SAVED or source.kind == "parquet" or (
                source.kind == "json" and suffix == ".jsonl"):
            continue
        raise ArgumentError(f"{flag} {source.path}: --streaming reads .jsonl, .parquet and "
                            f"saved datasets folders (it resumes from a row without reading "
                            f"the file up to it); convert it, or train without --streaming")


def check_renamed_columns(sources: Sequence[Source], columns: Dict[str, str],
                          flag: str = "--dataset") -> None:
    """Each --columns source column is in the first row of some file (read here, before
    any step; a stream cannot look at every row first, as sft without --streaming does)."""
    if not columns:
        return
    reader, present = RowReader(sources, flag), {}
    for index in range(len(sources)):
        for loc, _after, row in reader.rows(index, 0, 0):
            if loc[0] == index:
                present.update(dict.fromkeys(row))
            break
    missing = [c for c in columns if c not in present]
    if missing:
        what = sources[0].path if len(sources) == 1 else f"{len(sources)} files"
        shown = ", ".join(repr(c) for c in present) or "none"
        raise ArgumentError(f"{flag} {what}: --columns renames '{missing[0]}', a column the "
                            f"data does not have (the first row of each file has {shown})")


def stream_identity(sources: Sequence[Source]) -> List[list]:
    """Per file: its kind, size and the sha256 of its first and last MiB. Cheap for files
    too large to hash whole; the rows a resumed stream re-reads are checked besides
    (``Stream.restore``)."""
    from .sources import _files_of

    identity = []
    for source in sources:
        for path in _files_of(source):
            size = os.path.getsize(path)
            digest = hashlib.sha256()
            with open(path, "rb") as fh:
                digest.update(fh.read(EDGE_BYTES))
                if size > EDGE_BYTES:
                    fh.seek(max(EDGE_BYTES, size - EDGE_BYTES))
                    digest.update(fh.read(EDGE_BYTES))
            rel = os.path.relpath(path, source.path) if source.kind == SAVED else ""
            identity.append([source.kind, rel, size, digest.hexdigest()])
    return identity


def file_sizes(sources: Sequence[Source]) -> List[list]:
    """[path, size] of each file the stream reads, saved with its position (by the main
    process's StreamIterator, not with every batch of the loader worker): a resume on
    files that changed since is refused naming the file (``changed_files``)."""
    from .sources import _files_of

    return [[path, os.path.getsize(path)] for source in sources
            for path in _files_of(source)]


def changed_files(position, sources: Sequence[Source], flag: str = "--dataset") -> List[str]:
    """The resume check's lines naming the stream's files that are not those of the saved
    ``position`` (other paths, or another size: grown or cut since the checkpoint)."""
    saved = position.get("files") if isinstance(position, dict) else None
    if not isinstance(saved, list):
        return []  # a position saved before it named its files
    try:
        now = file_sizes(sources)
    except OSError:
        return []  # the sources check names a missing file
    if len(saved) != len(now):
        return [f"{flag}: the stream read {len(saved)} file(s) at the checkpoint, "
                f"{len(now)} now"]
    lines = []
    for i, (before, (path, size)) in enumerate(zip(saved, now)):
        if not (isinstance(before, list) and len(before) == 2):
            return []
        if before[0] != path:
            lines.append(f"{flag}: file {i + 1} was {before[0]} at the checkpoint, now {path}")
        elif before[1] != size:
            lines.append(f"{flag} {path}: {before[1]} bytes at the checkpoint, {size} now "
                         f"(a streamed file must stay as it is until the run ends)")
    return lines


def _digest(row) -> str:
    return hashlib.sha1(json.dumps(row, sort_keys=True, default=str).encode()).hexdigest()


# ---- reading rows from a position ---------------------------------------------------------

class RowReader:
    """Rows of the sources from a position on, and single rows by their locators."""

    def __init__(self, sources: Sequence[Source], flag: str = "--dataset"):
        self.sources = list(sources)
        self.flag = flag
        self._saved: Dict[int, object] = {}

    def where(self, loc: Locator) -> str:
        return f"{self.flag} {self.sources[loc[0]].path}, row {loc[1]}"

    def rows(self, file: int, row: int, offset: int) -> Iterator[Tuple[Locator, tuple, dict]]:
        """(locator, the position after it, row) from (file, row, offset) to the end of the
        last file."""
        for index in range(file, len(self.sources)):
            start = (row, offset) if index == file else (0, 0)
            kind = self.sources[index].kind
            read = (self._jsonl if kind == "json" else self._parquet if kind == "parquet"
                    else self._saved_rows)
            yield from read(index, *start)

    def _jsonl(self, index: int, row: int, offset: int):
        path = self.sources[index].path
        check_regular(path, f"{self.flag} {path}")
        with open(path, "rb") as fh:
            fh.seek(offset)
            while True:
                line = fh.readline()
                if not line:
                    return
                here, offset = offset, offset + len(line)
                if not line.strip():
                    continue
                loc = (index, row, here)
                yield loc, (index, row + 1, offset), self._parse(line, loc)
                row += 1

    def _parse(self, line: bytes, loc: Locator) -> dict:
        value = loads(line, self.where(loc))
        if not isinstance(value, dict):
            raise ArgumentError(f"{self.where(loc)}: a JSON {type(value).__name__}, not an "
                                f"object (one conversation per line)")
        return value

    def _parquet_file(self, index: int):
        import pyarrow.parquet as pq

        path = self.sources[index].path
        check_regular(path, f"{self.flag} {path}")
        try:
            return pq.ParquetFile(path)
        except Exception as err:  # pyarrow raises several types for a file it cannot read
            raise ArgumentError(f"{self.flag} {path}: cannot be read as parquet data "
                                f"({type(err).__name__}: {str(err)[:200]})") from None

    def _parquet(self, index: int, row: int, _offset: int):
        pf = self._parquet_file(index)
        first = 0
        for group in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(group).num_rows
            if row < first + n:
                rows = pf.read_row_group(group).to_pylist()
                for i in range(row - first, n):
                    yield (index, first + i, 0), (index, first + i + 1, 0), rows[i]
                row = first + n
            first += n

    def _dataset(self, index: int):
        if index not in self._saved:
            from .sources import _open_saved

            self._saved[index] = _open_saved(self.sources[index], self.flag)
        return self._saved[index]

    def _saved_rows(self, index: int, row: int, _offset: int):
        data = self._dataset(index)
        for start in range(row, len(data), 256):
            batch = data[start:start + 256]
            names = list(batch)
            for i, values in enumerate(zip(*(batch[n] for n in names))):
                yield ((index, start + i, 0), (index, start + i + 1, 0),
                       dict(zip(names, values)))

    def fetch(self, locators: Sequence[Locator]) -> Dict[Locator, dict]:
        """The rows at ``locators`` (each read directly, not from its file's start)."""
        found: Dict[Locator, dict] = {}
        by_file = collections.defaultdict(list)
        for loc in locators:
            by_file[loc[0]].append(tuple(loc))
        for index, locs in by_file.items():
            if not 0 <= index < len(self.sources):
                raise CheckpointError(f"the stream position names file {index}, but "
                                      f"--dataset has {len(self.sources)} files")
            kind = self.sources[index].kind
            if kind == "json":
                path = self.sources[index].path
                with open(path, "rb") as fh:
                    for loc in locs:
                        fh.seek(loc[2])
                        line = fh.readline()
                        try:
                            if not line.strip():
                                raise ArgumentError("a blank line" if line else
                                                    "the file ends before it")
                            found[loc] = self._parse(line, loc)
                        except ArgumentError as err:
                            # the file was edited or cut: no row starts at the saved offset
                            detail = str(err).removeprefix(f"{self.where(loc)}: ")
                            raise CheckpointError(
                                f"the stream position names {self.where(loc)} at byte "
                                f"{loc[2]}, which is not a row now ({detail}): the data "
                                f"changed since the checkpoint; resume on the same files"
                            ) from None
            elif kind == "parquet":
                pf = self._parquet_file(index)
                bounds = np.cumsum([0] + [pf.metadata.row_group(g).num_rows
                                          for g in range(pf.metadata.num_row_groups)])
                groups: Dict[int, list] = {}
                for loc in locs:
                    group = int(np.searchsorted(bounds, loc[1], side="right")) - 1
                    if not 0 <= group < pf.metadata.num_row_groups:
                        raise CheckpointError(f"the stream position names {self.where(loc)}, "
                                              f"which the file does not have")
                    if group not in groups:
                        groups[group] = pf.read_row_group(group).to_pylist()
                    found[loc] = groups[group][loc[1] - bounds[group]]
            else:
                data = self._dataset(index)
                for loc in locs:
                    if loc[1] >= len(data):
                        raise CheckpointError(f"the stream position names {self.where(loc)}, "
                                              f"which the dataset does not have")
                    found[loc] = data[loc[1]]
        return found


# ---- the global stream --------------------------------------------------------------------

class Sample:
    """One fitted sample of an encoded row: where it came from and its arrays."""

    __slots__ = ("loc", "k", "digest", "ids", "targets")

    def __init__(self, loc, k, digest, ids, targets):
        self.loc, self.k, self.digest, self.ids, self.targets = loc, k, digest, ids, targets

    @property
    def positions(self) -> int:
        return len(self.ids) - 1

    def ref(self) -> list:
        return [*self.loc, self.k]


class ShuffledRows:
    """The rows of the sources, epoch after epoch, drawn through a seeded shuffle buffer of
    ``buffer_size`` rows: the reading and shuffling every stream (sft and pt) shares, with
    its exact position (``state``, ``restore``)."""

    def __init__(self, sources, buffer_size: int, seed: int, flag: str = "--dataset"):
        self.reader = RowReader(sources, flag)
        self.buffer_size = buffer_size
        self.rng = np.random.default_rng([seed, 0x57E4])
        self.epoch, self.next_pos = 0, (0, 0, 0)
        self.buffer: List[Tuple[Locator, dict, str]] = []
        self._rows: Optional[Iterator] = None
        self.pass_rows: Optional[int] = None  # rows in one pass over the files, once known
        self._rows_this_pass = 0
        self._whole_pass = False

    def _read_in_pass(self) -> Optional[Tuple[Locator, dict, str]]:
        """The next row of this pass over the files; None at its end (the next call reads
        the next epoch's first row)."""
        if self._rows is None:
            self._whole_pass = self.next_pos == (0, 0, 0)
            self._rows = self.reader.rows(*self.next_pos)
        for loc, after, row in self._rows:
            self.next_pos = after
            self._rows_this_pass += 1
            return loc, row, _digest(row)
        if self._whole_pass:
            self.pass_rows = self._rows_this_pass
        self.epoch, self.next_pos, self._rows = self.epoch + 1, (0, 0, 0), None
        self._rows_this_pass = 0
        return None

    def _read(self) -> Tuple[Locator, dict, str]:
        for _attempt in range(2):
            entry = self._read_in_pass()
            if entry is not None:
                return entry
        raise ArgumentError(f"{self.reader.flag}: no rows to stream (the files are empty)")

    def next_row(self) -> Tuple[Locator, dict, str]:
        """(locator, row, digest) of the next row drawn from the buffer."""
        while len(self.buffer) < self.buffer_size:
            entry = self._read_in_pass()
            if entry is None and self.buffer:
                # A pass over the files ended before the buffer was full: the buffer holds
                # the whole data, once (filling on would hold rows of the next epoch again,
                # and a buffer far larger than the data would read without end).
                self.buffer_size = len(self.buffer)
                break
            self.buffer.append(entry if entry is not None else self._read())
        slot = int(self.rng.integers(self.buffer_size))
        row = self.buffer[slot]
        self.buffer[slot] = self._read()
        return row

    def state(self) -> dict:
        return {"epoch": self.epoch, "next": list(self.next_pos),
                "rng": self.rng.bit_generator.state,
                "buffer": [list(entry[0]) for entry in self.buffer]}

    def digests(self) -> List[str]:
        return [entry[2] for entry in self.buffer]

    def restore(self, state: dict, held: Sequence[Locator]) -> Dict[Locator, Tuple[dict, str]]:
        """Continue from ``state``; returns {locator: (row, digest)} of the rows named by
        ``held`` (the stream's own: rows encoded but not yet trained), read in the same
        pass as the buffer's."""
        try:
            epoch = int(state["epoch"])
            next_pos = tuple(int(v) for v in state["next"])
            self.rng.bit_generator.state = state["rng"]
            buffer = [tuple(int(v) for v in loc) for loc in state["buffer"]]
        except (KeyError, TypeError, ValueError) as err:
            raise malformed(err) from None
        self.epoch, self.next_pos = epoch, next_pos
        if buffer:
            # a buffer saved smaller than --shuffle_buffer_size holds the whole data
            self.buffer_size = min(self.buffer_size, len(buffer))
        rows = self.reader.fetch(buffer + list(held))
        found = {loc: (row, _digest(row)) for loc, row in rows.items()}
        self.buffer = [(loc, *found[loc]) for loc in buffer]
        return found


def malformed(err: Exception) -> CheckpointError:
    return CheckpointError(f"the stream position in the checkpoint is malformed "
                           f"({type(err).__name__}: {err})")


def check_version(state: dict) -> None:
    if state.get("version") != STREAM_VERSION:
        raise CheckpointError(f"the stream position has version {state.get('version')!r}; "
                              f"this swift-mcore reads version {STREAM_VERSION}")


def held_digest(digests: Sequence[str]) -> str:
    return hashlib.sha256("".join(digests).encode()).hexdigest()


DATA_CHANGED = ("the rows the stream held at the checkpoint (its shuffle buffer and rows not "
                "yet trained) differ from those in --dataset now: the data changed since the "
                "checkpoint; resume on the same files")


class RowStream:
    """What sft's Stream and pt's TextStream share: the shuffled rows, the global position,
    the stop for files with nothing to train, and the frame of the position's state (the
    version, the position, the rows' state and the digest of every row held).

    A subclass sets its own fields, then calls ``__init__``; it gives ``_held`` (its part
    of the state and the digests of the rows it holds), ``_parse`` (its part read back from
    a state, raising KeyError/TypeError/ValueError when malformed), ``_held_locators`` and
    ``_rebuild`` (its rows re-read by ``ShuffledRows.restore``)."""

    KIND: dict = {}  # state keys naming the kind of stream, before the position

    def __init__(self, sources, buffer_size: int, seed: int, state: Optional[dict],
                 flag: str):
        self.rows = ShuffledRows(sources, buffer_size, seed, flag)
        self.reader = self.rows.reader
        self.buffer_size = buffer_size
        self.position = 0
        self._empty_rows = 0
        if state:
            self._restore(state)

    @property
    def epoch(self) -> int:
        return self.rows.epoch

    def _count_row(self, trainable: bool, nothing: str) -> None:
        """Stop with ``nothing`` (after the flag) once more rows in a row than two passes
        over the files and the buffer gave nothing to train: no row of the files does."""
        self._empty_rows = 0 if trainable else self._empty_rows + 1
        passes = self.rows.pass_rows
        if passes and self._empty_rows > 2 * (passes + self.rows.buffer_size):
            raise ArgumentError(f"{self.reader.flag}: {nothing}")

    def state(self) -> dict:
        """The exact position, as JSON-ready values: what follows it is the same in a stream
        built from it as in this one."""
        own, digests = self._held()
        return {"version": STREAM_VERSION, **self.KIND, "position": self.position,
                **self.rows.state(), **own,
                "rows_digest": held_digest(self.rows.digests() + digests)}

    def _restore(self, state: dict) -> None:
        check_version(state)
        try:
            parsed = self._parse(state)
            self.position = int(state["position"])
            expected = str(state["rows_digest"])
        except (KeyError, TypeError, ValueError) as err:
            raise malformed(err) from None
        rows = self.rows.restore(state, self._held_locators(parsed))
        self._rebuild(parsed, rows)
        if self.state()["rows_digest"] != expected:
            raise CheckpointError(DATA_CHANGED)

    def _held(self) -> Tuple[dict, List[str]]:
        raise NotImplementedError

    def _parse(self, state: dict):
        raise NotImplementedError

    def _held_locators(self, parsed) -> List[Locator]:
        raise NotImplementedError

    def _rebuild(self, parsed, rows: Dict[Locator, Tuple[dict, str]]) -> None:
        raise NotImplementedError


class Stream(RowStream):
    """The global sequence of sft training rows (lists of Samples), with a position that
    ``state()`` captures and ``Stream(..., state)`` continues from exactly."""

    def __init__(self, sources, columns: Dict[str, str], template, loss_on: str,
                 seq_length: int, truncation: str, packing: bool, buffer_size: int,
                 seed: int, state: Optional[dict] = None, flag: str = "--dataset"):
        self.columns, self.template, self.loss_on = columns, template, loss_on
        self.seq_length, self.truncation, self.packing = seq_length, truncation, packing
        self.queue: collections.deque = collections.deque()  # training rows ready
        self.open_rows: List[List[Sample]] = []
        super().__init__(sources, buffer_size, seed, state, flag)

    # -- encoding
    def _encode(self, drawn: Sequence[Tuple[Locator, dict, str]]) -> List[List[Sample]]:
        """The fitted samples of each drawn row, the rows tokenized in one call."""
        from .conversations import _refuse_media, to_conversation
        from .sft_samples import encode_each

        conversations = []
        for loc, row, _digest in drawn:
            where = self.reader.where(loc)
            row = {self.columns.get(k, k): v for k, v in row.items()}
            _refuse_media(row, where)
            conversations.append(to_conversation(row, where))
        out = []
        for (loc, _row, digest), tokenized in zip(
                drawn, encode_each(conversations, self.template, self.loss_on)):
            fitted = tokenized.fit(self.seq_length, self.truncation)
            out.append([Sample(tuple(loc), k, digest, *fitted.sample(k))
                        for k in range(len(fitted))])
        return out

    def _samples(self, loc: Locator, row: dict, digest: str) -> List[Sample]:
        return self._encode([(loc, row, digest)])[0]

    def _add(self, sample: Sample) -> None:
        if not self.packing:
            self.queue.append([sample])
            return
        room = [self.seq_length - sum(s.positions for s in r) for r in self.open_rows]
        fits = [i for i, left in enumerate(room) if left >= sample.positions]
        if fits:
            self.open_rows[min(fits, key=lambda i: (room[i], i))].append(sample)
            return
        if len(self.open_rows) >= OPEN_ROWS:
            fullest = min(range(len(room)), key=lambda i: (room[i], i))
            self.queue.append(self.open_rows.pop(fullest))
        self.open_rows.append([sample])

    def next_item(self) -> List[Sample]:
        """The next training row (its samples) of the global stream."""
        while not self.queue:
            # Rows are drawn and encoded ENCODE_ROWS at a time (one tokenizer call); their
            # samples are added in draw order, so the rows trained are those of drawing one
            # at a time, and the samples not trained yet are held in the position.
            drawn = [self.rows.next_row() for _ in range(ENCODE_ROWS)]
            for samples in self._encode(drawn):
                self._count_row(bool(samples), "no conversation is left to train on; raise "
                                "--seq_length or use --truncation_strategy left|right")
                for sample in samples:
                    self._add(sample)
        self.position += 1
        return self.queue.popleft()

    # -- the position
    def _held(self) -> Tuple[dict, List[str]]:
        items = list(self.queue) + self.open_rows
        return ({"queue": [[s.ref() for s in item] for item in self.queue],
                 "open_rows": [[s.ref() for s in item] for item in self.open_rows]},
                [s.digest for item in items for s in item])

    def _parse(self, state: dict):
        queue = [[tuple(int(v) for v in ref) for ref in item] for item in state["queue"]]
        open_rows = [[tuple(int(v) for v in ref) for ref in item]
                     for item in state["open_rows"]]
        return queue, open_rows

    def _held_locators(self, parsed) -> List[Locator]:
        queue, open_rows = parsed
        return [ref[:3] for item in queue + open_rows for ref in item]

    def _rebuild(self, parsed, rows) -> None:
        queue, open_rows = parsed
        encoded: Dict[Locator, List[Sample]] = {}

        def sample(ref) -> Sample:
            loc = ref[:3]
            if loc not in encoded:
                encoded[loc] = self._samples(loc, *rows[loc])
            if ref[3] >= len(encoded[loc]):
                raise CheckpointError(f"the stream position names sample {ref[3]} of "
                                      f"{self.reader.where(loc)}, which has "
                                      f"{len(encoded[loc])}: the data changed")
            return encoded[loc][ref[3]]

        self.queue = collections.deque([sample(r) for r in item] for item in queue)
        self.open_rows = [[sample(r) for r in item] for item in open_rows]


# ---- training rows and the per-rank iterator ----------------------------------------------

def row_arrays(samples: List[Sample]) -> Dict[str, np.ndarray]:
    """A training row of samples laid end to end (SftDataset.__getitem__'s fields)."""
    tokens, labels, mask, positions, segments = [], [], [], [], []
    for segment, s in enumerate(samples):
        tokens.append(s.ids[:-1])
        labels.append(s.ids[1:])
        mask.append(s.targets[1:])
        positions.append(np.arange(len(s.ids) - 1))
        segments.append(np.full(len(s.ids) - 1, segment))
    return {"tokens": np.concatenate(tokens), "labels": np.concatenate(labels),
            "loss_mask": np.concatenate(mask), "position_ids": np.concatenate(positions),
            "segment_ids": np.concatenate(segments)}


class StreamingSftDataset:
    """--streaming's training data: the stream's definition (files, template, flags), no
    length. ``collate`` is SftDataset's (``collator``)."""

    streaming = True

    def __init__(self, sources, columns, template, loss_on: str, seq_length: int,
                 truncation: str, packing: bool, buffer_size: int, seed: int, collator,
                 fingerprint: str):
        self.sources, self.columns, self.template = list(sources), columns, template
        self.loss_on, self.seq_length, self.truncation = loss_on, seq_length, truncation
        self.packing, self.buffer_size, self.seed = packing, buffer_size, seed
        self.collator = collator
        self.fingerprint = fingerprint

    def stream(self, state: Optional[dict] = None) -> Stream:
        return Stream(self.sources, self.columns, self.template, self.loss_on,
                      self.seq_length, self.truncation, self.packing, self.buffer_size,
                      self.seed, state)

    def collate_items(self, items: List[List[Sample]]) -> Dict[str, torch.Tensor]:
        """A micro-batch of training rows, as SftDataset batches them."""
        return self.collator.collate([row_arrays(item) for item in items])


class _RankBatches(torch.utils.data.IterableDataset):
    """This rank's micro-batches of the global stream of ``dataset`` (a streaming dataset:
    ``stream(state)`` and ``collate_items``), from a position on. The last
    micro-batch of each global batch carries the stream's position after that batch
    (``stream_state``); a row that cannot be read or encoded arrives as ``error``."""

    def __init__(self, dataset, state, consumed: int, mbs: int,
                 gbs: int, dp_rank: int, dp_size: int):
        self.dataset, self.state, self.consumed = dataset, state, consumed
        self.mbs, self.gbs, self.dp_rank, self.dp_size = mbs, gbs, dp_rank, dp_size

    def __iter__(self):
        from .sampler import micro_batches

        try:
            stream = self.dataset.stream(self.state)
            positions = micro_batches(self.consumed, self.mbs, self.gbs, self.dp_rank,
                                      self.dp_size)
            per_batch = self.gbs // (self.mbs * self.dp_size)
            batch_start = self.consumed
            while True:
                items = [stream.next_item() for _ in range(self.gbs)]
                state = stream.state()
                for m in range(per_batch):
                    mine = next(positions)
                    batch = self.dataset.collate_items(
                        [items[p - batch_start] for p in mine])
                    batch["sample_ids"] = torch.tensor(mine, dtype=torch.int64)
                    if m == per_batch - 1:
                        batch["stream_state"] = state
                    yield batch
                batch_start += self.gbs
        except (ArgumentError, CheckpointError) as err:
            yield {"error": str(err), "kind": type(err).__name__}


class StreamIterator:
    """The trainer's iterator over a stream: hands out micro-batches and keeps the position
    of the last global batch handed out whole (``position``, saved with checkpoints)."""

    def __init__(self, iterator, position: Optional[dict], files: List[list]):
        self._iterator = iterator
        self.position = position
        self._files = files  # saved with the position (``changed_files``)

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self._iterator)
        if "error" in batch:
            # The worker's stream has ended; end the worker too, now: it ignores SIGTERM
            # (loader.ignore_stop_signals), and a caller that goes on (an API user's
            # script) would otherwise leave it for the interpreter's exit to wait on.
            shutdown = getattr(self._iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            cls = CheckpointError if batch.get("kind") == "CheckpointError" else ArgumentError
            raise cls(batch["error"])
        state = batch.pop("stream_state", None)
        if state is not None:
            self.position = {**state, "files": self._files}
        return batch


def build_stream_iterator(dataset, consumed_samples: int,
                          position: Optional[dict], config, dp_rank: int = 0,
                          dp_size: int = 1) -> StreamIterator:
    """The training iterator of a streaming run (sft's StreamingSftDataset, pt's
    text_stream.StreamingTextDataset), continuing from a checkpoint's stream ``position`` (None: from the start). The position is checked here, in the main process,
    before any step: it must be the one of ``consumed_samples``, and the rows it holds
    must read back unchanged."""
    from .loader import close_workers_at_exit, ignore_stop_signals

    if consumed_samples and position is None:
        raise CheckpointError(f"the checkpoint holds no stream position (it was not saved by "
                              f"a --streaming run) but {consumed_samples} samples were "
                              f"trained; resume it without --streaming")
    if position is not None:
        at = position.get("position") if isinstance(position, dict) else None
        if at != consumed_samples:
            raise CheckpointError(f"the checkpoint's stream position is at sample {at}, its "
                                  f"counters at {consumed_samples}: the checkpoint is "
                                  f"inconsistent")
        dataset.stream(position)  # re-reads the held rows: a changed file stops here
    workers = int(config.data.num_workers)
    loader = torch.utils.data.DataLoader(
        _RankBatches(dataset, position, consumed_samples, config.training.micro_batch_size,
                     config.training.global_batch_size, dp_rank, dp_size),
        batch_size=None, num_workers=workers,
        worker_init_fn=ignore_stop_signals if workers > 0 else None,
        prefetch_factor=2 if workers > 0 else None, pin_memory=config.cuda,
        # iter() draws the workers' base seed from this generator, not from the global torch
        # RNG, which a resumed run has just restored (the dropout stream)
        generator=torch.Generator().manual_seed(config.training.seed))
    iterator = iter(loader)
    if workers > 0:
        close_workers_at_exit(iterator)
    return StreamIterator(iterator, position, file_sizes(dataset.sources))
