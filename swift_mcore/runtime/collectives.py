"""Collectives that also work without a process group: broadcast, gather, a tensor reduced
on the backend's device, and one rank's decision or error handed to all (so ranks fail
together instead of hanging)."""

from __future__ import annotations

from typing import Any, List

import torch
import torch.distributed as dist

from .distributed import rank


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if initialized() else 1


def backend_device(group=None) -> torch.device:
    """Where a tensor must live for a collective over ``group``: this rank's GPU under NCCL
    (which refuses CPU tensors), the CPU under gloo or without a process group."""
    if initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(tensor: torch.Tensor, op=None, group=None) -> torch.Tensor:
    """``tensor`` reduced over ``group`` (SUM unless ``op``), on the backend's device: the
    result is a new tensor there (the input is left as it is when it had to move)."""
    if not initialized():
        return tensor
    tensor = tensor.to(backend_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return tensor


def broadcast(obj: Any, src: int = 0) -> Any:
    """``obj`` from rank ``src`` on every rank (over the wire only; nothing on disk)."""
    if not initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather(obj: Any) -> List[Any]:
    if not initialized() or dist.get_world_size() == 1:
        return [obj]
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def decide(fn, *args, **kwargs) -> Any:
    """Run ``fn`` on rank 0 and hand its result, or its CheckpointError, to every rank, so
    all ranks take the same decision and raise the same error together (no hang)."""
    from ..errors import CheckpointError

    result, error = None, None
    if rank() == 0:
        try:
            result = fn(*args, **kwargs)
        except CheckpointError as err:
            error = str(err)
        except Exception as err:  # an OSError on rank 0 must not leave the others waiting
            error = f"{type(err).__name__}: {err}"

    result, error = broadcast((result, error))
    if error is not None:
        raise CheckpointError(error)
    return result


def attempt(fn, *args, **kwargs) -> str | None:
    """Run ``fn`` on this rank; None if it worked, else the error as text (to hand to
    ``raise_if_any``, so that a failure on one rank is raised on all of them)."""
    try:
        fn(*args, **kwargs)
    except Exception as err:
        return f"rank {rank()}: {type(err).__name__}: {err}"
    return None


def raise_if_any(error: str | None) -> None:
    """Raise a CheckpointError on every rank if any rank reports one."""
    from ..errors import CheckpointError

    errors = [e for e in all_gather(error) if e]
    if errors:
        raise CheckpointError(errors[0])
