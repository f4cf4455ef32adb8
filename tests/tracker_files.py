"""Reads back what the trackers wrote locally: W&B's offline .wandb files, SwanLab's offline
.swanlab files and TensorBoard's event files, as {(split/metric, iteration): value}."""

from __future__ import annotations

import glob
import json
import os
import struct
import zlib
from typing import Dict, Iterator, List, Tuple

Values = Dict[Tuple[str, int], float]


def jsonl_values(output_dir) -> Values:
    """metrics.jsonl's train and valid records as {(split/metric, iteration): value}."""
    out: Values = {}
    with open(os.path.join(output_dir, "metrics.jsonl")) as fh:
        for record in map(json.loads, fh):
            if record["split"] in ("train", "valid"):
                for key, value in record.items():
                    if key not in ("split", "iteration"):
                        out[(f"{record['split']}/{key}", record["iteration"])] = value
    return out


# ---- W&B --------------------------------------------------------------------------------
# A .wandb file is W&B's transaction log: a 7-byte header (":W&B", magic 0xBEE1, version 0),
# then LevelDB's log format (32 KiB blocks of chunks: CRC-32, length, type; FULL, or FIRST,
# MIDDLE..., LAST), each record a wandb_internal_pb2.Record. wandb 0.31 ships no Python
# reader (its sync is in wandb-core), so the test reads the format itself.
_BLOCK, _CHUNK_HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: str) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        data = fh.read()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    pos, parts = 7, []
    while pos + _CHUNK_HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + _CHUNK_HEADER])
        chunk = data[pos + _CHUNK_HEADER:pos + _CHUNK_HEADER + length]
        if kind == 0 and length == 0:  # zero padding up to the block's end
            pos += left
            continue
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, path
        pos += _CHUNK_HEADER + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            parts = [chunk]
        elif kind == _MIDDLE:
            parts.append(chunk)
        elif kind == _LAST:
            yield b"".join(parts + [chunk])


def wandb_runs(output_dir) -> List[dict]:
    """Each offline run under output_dir/wandb, oldest first: its id, config and the
    history rows it logged."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = []
    for path in sorted(glob.glob(os.path.join(str(output_dir), "wandb", "offline-run-*",
                                              "run-*.wandb"))):
        run = {"id": None, "config": {}, "history": []}
        for raw in wandb_records(path):
            record = pb.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"] = record.run.run_id
                for item in record.run.config.update:
                    run["config"][item.key] = json.loads(item.value_json)
            elif kind == "config":
                for item in record.config.update:
                    run["config"][item.key] = json.loads(item.value_json)
            elif kind == "history":
                run["history"].append({(item.key or "/".join(item.nested_key)):
                                       json.loads(item.value_json)
                                       for item in record.history.item})
        runs.append(run)
    return runs


def wandb_values(runs: List[dict]) -> Values:
    out: Values = {}
    for run in runs:
        for row in run["history"]:
            for key, value in row.items():
                if key.startswith(("train/", "valid/")):
                    out[(key, row["iteration"])] = value
    return out


# ---- SwanLab ----------------------------------------------------------------------------
def swanlab_runs(output_dir) -> List[dict]:
    """Each offline run under output_dir/swanlog (read with SwanLab's own reader), oldest
    first: its id and the scalars it logged."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    runs = []
    for path in sorted(glob.glob(os.path.join(str(output_dir), "swanlog", "run-*",
                                              "run-*.swanlab"))):
        run = {"id": os.path.basename(path)[len("run-"):-len(".swanlab")], "scalars": {}}
        reader = DataStoreReader()
        reader.open(path)
        try:
            for raw in reader:
                record = Record()
                record.ParseFromString(raw)
                if record.HasField("scalar"):
                    scalar = record.scalar
                    run["scalars"][(scalar.key, scalar.step)] = scalar.value.number
        finally:
            reader.close()
        runs.append(run)
    return runs


def swanlab_values(runs: List[dict]) -> Values:
    out: Values = {}
    for run in runs:
        out.update(run["scalars"])
    return out


# ---- TensorBoard ------------------------------------------------------------------------
def tensorboard_values(output_dir) -> Values:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: Values = {}
    for path in sorted(glob.glob(os.path.join(str(output_dir), "runs", "events.out.*"))):
        events = EventAccumulator(path, size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            for event in events.Scalars(tag):
                out[(tag, event.step)] = event.value
    return out
