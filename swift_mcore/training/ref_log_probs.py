"""--precompute_ref_log_probs: the reference's log-probability of every pair's answers,
computed in one pass before training and kept in the run folder, fingerprinted.

The file, ``<output_dir>/ref_logps.safetensors``, holds a float32 tensor [pairs, 2] (chosen,
rejected) and in its metadata the fingerprint of the data and the reference it was computed
from (the run's data fingerprint, which carries the reference's content hash). A later run
or resume in that folder reads it instead of computing; one of other data or another
reference is refused, naming the flag. Written atomically (a new sibling renamed over it).
"""

from __future__ import annotations

import os
import struct
from typing import Callable

import torch

from ..errors import ArgumentError

FILE = "ref_logps.safetensors"
FLAG = "--precompute_ref_log_probs"
MAGIC_KEY = "swift_mcore.ref_logps"


def path_in(output_dir: str) -> str:
    return os.path.join(output_dir, FILE)


def compute(dataset, micro_batch: int, forward: Callable) -> torch.Tensor:
    """[pairs, 2]: ``forward(batch)`` (the reference's summed log-probabilities of the
    batch's rows, chosen rows first) over the dataset in index order, ``micro_batch`` pairs
    at a time."""
    out = torch.empty(len(dataset), 2, dtype=torch.float32)
    for start in range(0, len(dataset), micro_batch):
        index = range(start, min(start + micro_batch, len(dataset)))
        batch = dataset.collate([dataset[i] for i in index])
        logps = forward(batch).detach().float().cpu()
        pairs = len(index)
        out[start:start + pairs, 0] = logps[:pairs]
        out[start:start + pairs, 1] = logps[pairs:]
    return out


def compute_in_stages(dataset, micro_batch: int, run: Callable,
                      groups: int = 1) -> torch.Tensor:
    """[pairs, 2] as ``compute`` gives it, under pipeline parallelism: ``run(batches, n)``
    runs megatron's schedule forward over the ``n`` micro-batches of the iterator
    ``batches`` and returns, on the last stage, each one's summed log-probabilities (chosen
    rows first). Stages exchange one fixed shape and the interleaved schedule runs the
    micro-batches in ``groups``, so the last micro-batches are filled up with the first
    pairs (their values are dropped). Zeros on the other stages."""
    count = -(-len(dataset) // micro_batch)
    count = -(-count // groups) * groups

    def batches():
        for number in range(count):
            index = [(number * micro_batch + i) % len(dataset) for i in range(micro_batch)]
            yield dataset.collate([dataset[i] for i in index])

    out = torch.zeros(len(dataset), 2, dtype=torch.float32)
    collected = run(batches(), count)
    if not collected:  # not the last stage
        return out
    for number, logps in enumerate(collected):
        start = number * micro_batch
        if start >= len(dataset):
            break
        logps = logps.detach().float().cpu()
        pairs = min(micro_batch, len(dataset) - start)
        out[start:start + pairs, 0] = logps[:pairs]
        out[start:start + pairs, 1] = logps[micro_batch:micro_batch + pairs]
    return out


def write(path: str, table: torch.Tensor, fingerprint: str) -> None:
    from safetensors.torch import save

    from ..atomic_write import write_atomic
    from ..runtime import run_files

    run_files.check(path)  # never through a link planted at that name
    write_atomic(path, save({"ref_logps": table.contiguous()},
                            metadata={MAGIC_KEY: fingerprint, "pairs": str(len(table))}))


def read(path: str, fingerprint: str, pairs: int):
    """The stored table if ``path`` exists and was computed for ``fingerprint`` (else
    ArgumentError naming the flag and the file); None when there is no file."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    from ..input_files import loads, open_regular

    if not os.path.lexists(path):
        return None
    where = f"{FLAG}: {path}"
    with open_regular(path, "rb", where=where) as fh:
        content = fh.read()
    try:
        (size,) = struct.unpack("<Q", content[:8])
        header = loads(content[8:8 + size], where)
        stored = header.get("__metadata__", {}).get(MAGIC_KEY)
        table = load(content)["ref_logps"]
    except (struct.error, AttributeError, KeyError, ValueError, RuntimeError,
            SafetensorError) as err:  # SafetensorError: a cut or garbled file
        raise ArgumentError(f"{where}: not a reference log-probability file written by "
                            f"swift-mcore ({type(err).__name__}); remove it") from None
    if stored != fingerprint or tuple(table.shape) != (pairs, 2):
        raise ArgumentError(f"{where} was computed for other data or another reference "
                            f"(fingerprint {str(stored)[:16]}..., this run's "
                            f"{fingerprint[:16]}...); remove it to compute it again, or use "
                            f"another --output_dir")
    table = table.float()
    if not torch.isfinite(table).all():  # an edited file: nan losses from the first step
        raise ArgumentError(f"{where}: holds nan or inf; remove it to compute it again")
    return table
