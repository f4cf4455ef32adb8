"""What someone who can write a checkpoint folder can plant there: pickles whose loading
would run code (a marker file appears), garbage in place of JSON, and a manifest re-sealed
so that the tampered file passes the CRC check and reaches the loader itself."""

from __future__ import annotations

import io
import json
import os
import pickle
from typing import Tuple

import torch

from swift_mcore.checkpointing import commit
from swift_mcore.checkpointing.safe_load import read_dcp_metadata

GARBAGE = bytes(range(256)) * 4  # not UTF-8, not JSON, not a pickle


class Evil:
    """Unpickling it runs ``touch marker``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def torch_saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def replace_item(folder: str, prefix: str, payload: bytes) -> Tuple[str, str]:
    """Point the first .distcp item whose name starts with ``prefix`` at ``payload``
    (appended to its .distcp file); .metadata is rewritten to match. Returns the item's
    name and its file. (The items' order differs from save to save.)"""
    metadata = read_dcp_metadata(folder)
    for index, info in sorted(metadata.storage_data.items(), key=lambda kv: kv[0].fqn):
        if index.fqn.startswith(prefix):
            path = os.path.join(folder, info.relative_path)
            info.offset, info.length = os.path.getsize(path), len(payload)
            with open(path, "ab") as fh:
                fh.write(payload)
            break
    else:
        raise KeyError(prefix)
    metadata.storage_meta = None
    with open(os.path.join(folder, ".metadata"), "wb") as fh:
        pickle.dump(metadata, fh)
    return index.fqn, info.relative_path


def write(folder: str, name: str, data: bytes) -> None:
    with open(os.path.join(folder, name), "wb") as fh:
        fh.write(data)


def reseal(folder: str) -> None:
    """Recompute the manifest's sizes and CRCs (keeping its id and parent), as commit.seal
    would: the tampered files now pass every checksum."""
    path = os.path.join(folder, commit.MANIFEST_FILENAME)
    with open(path, encoding="utf-8") as fh:
        manifest = json.load(fh)
    table = {}
    for rel in commit.list_files(folder):
        if rel != commit.MANIFEST_FILENAME:
            size, crc = commit.checksum(os.path.join(folder, rel))
            table[rel] = {"size": size, "crc32": crc}
    manifest["files"] = table
    commit.write_manifest(folder, manifest)
