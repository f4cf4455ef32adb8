"""Whether loaded weights hold nan or inf, naming the first tensor that does.

A checkpoint or weight file holding nan (bit rot its checksums were resealed over, an
external writer, a Megatron-LM checkpoint, which has no checksums) would otherwise be
resumed, exported and served without a word, and the non-finite stop would then name it as
the newest good checkpoint. One ``isfinite`` pass over the loaded tensors costs little next
to reading them from disk.
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch

# Elements checked at once: bounds the temporary boolean mask of a large embedding.
_CHUNK = 1 << 24


def nonfinite(tensor: torch.Tensor) -> Optional[str]:
    """None if every value of ``tensor`` is finite, else what is wrong ('3 nan and 1 inf
    of 4096 values')."""
    if not tensor.is_floating_point() and not tensor.is_complex():
        return None
    flat = tensor.detach().reshape(-1)
    if all(bool(torch.isfinite(part).all()) for part in flat.split(_CHUNK)):
        return None
    nan = sum(int(torch.isnan(part).sum()) for part in flat.split(_CHUNK))
    inf = sum(int(torch.isinf(part).sum()) for part in flat.split(_CHUNK))
    found = " and ".join(f"{n} {kind}" for n, kind in ((nan, "nan"), (inf, "inf")) if n)
    return f"{found} of {flat.numel()} values"


def first_nonfinite(named: Iterable[Tuple[str, torch.Tensor]]) -> Optional[str]:
    """'NAME holds 3 nan of 4096 values' for the first tensor of ``named`` that is not
    finite; None if all are."""
    for name, tensor in named:
        problem = nonfinite(tensor)
        if problem:
            return f"{name} holds {problem}"
    return None


def model_problem(model_chunks, folder: str) -> Optional[str]:
    """This rank's view of a model just loaded from ``folder``: None if all its parameters
    are finite, else one line naming the first that is not (for comm.raise_if_any)."""
    from ..runtime.ddp import unwrap

    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    for chunk in chunks:
        problem = first_nonfinite(unwrap(chunk).named_parameters())
        if problem:
            return (f"checkpoint {folder} cannot be used: its weights are not finite "
                    f"({problem}); use an earlier checkpoint. Nothing was changed on disk.")
    return None
