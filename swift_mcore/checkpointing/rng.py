"""RNG states (python, numpy, torch CPU, CUDA, megatron's tensor-parallel tracker) as JSON:
one file per rank, ``rng/rank_00000.json``, byte states base64-encoded. Nothing is pickled.

Restoring follows the rank's place in the parallel layout: the file of the same
(tensor, pipeline, data-parallel) coordinates when the TP and PP sizes are unchanged; with a
new data-parallel size, a rank beyond the saved ones takes data-parallel rank 0's state of
its (TP, PP) position (with megatron's seeding all data-parallel ranks of a position draw
the same stream, so that is the state it would have had). When the TP or PP size changed
there is no faithful mapping: the states are not restored and the log says so.
"""

from __future__ import annotations

import base64
import json
import os
import random
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

RNG_SUBDIR = "rng"


def rank_file(folder: str, rank: int) -> str:
    return os.path.join(folder, RNG_SUBDIR, f"rank_{rank:05d}.json")


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().contiguous().numpy().tobytes()).decode("ascii")


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def layout() -> Dict[str, int]:
    """This rank's (TP, PP, DP) coordinates and the sizes, as plain ints."""
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return {"tp_rank": ps.get_tensor_model_parallel_rank(),
                    "pp_rank": ps.get_pipeline_model_parallel_rank(),
                    "dp_rank": ps.get_data_parallel_rank(),
                    "tp_size": ps.get_tensor_model_parallel_world_size(),
                    "pp_size": ps.get_pipeline_model_parallel_world_size(),
                    "dp_size": ps.get_data_parallel_world_size()}
    except Exception:  # megatron not set up (a bare process): one rank of everything
        pass
    return {"tp_rank": 0, "pp_rank": 0, "dp_rank": 0, "tp_size": 1, "pp_size": 1, "dp_size": 1}


def _tracker():
    from megatron.core import tensor_parallel

    return tensor_parallel.get_cuda_rng_tracker()


def capture(cuda: bool) -> Dict[str, Any]:
    """Every RNG state of this process as JSON-ready data (``cuda``: RunConfig.cuda)."""
    version, py_state, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    tracker = {name: _b64(state) for name, state in _tracker().get_states().items()}
    cuda_state = None
    if cuda:
        # This rank's own GPU only: the other devices' generators are other ranks' (or
        # unused), and touching them all would restore them all.
        cuda_state = {"device": torch.cuda.current_device(),
                "state": _b64(torch.cuda.get_rng_state(torch.cuda.current_device()))}
    return {
        "python": {"version": version, "state": list(py_state), "gauss": gauss},
        "numpy": {"bit_generator": np_state["bit_generator"],
                  "key": np_state["state"]["key"].tolist(),
                  "pos": int(np_state["state"]["pos"]),
                  "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},
        "torch": _b64(torch.get_rng_state()),
        "cuda": cuda_state,
        "megatron_tracker": tracker,
    }


def apply(states: Dict[str, Any], cuda: bool) -> List[str]:
    """Set every RNG from ``capture()`` data. Returns the names of what was restored."""
    restored = []
    py = states["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    restored.append("python")
    npy = states["numpy"]
    np.random.set_state({"bit_generator": npy["bit_generator"],
                         "state": {"key": np.asarray(npy["key"], dtype=np.uint32),
                                   "pos": npy["pos"]},
                         "has_gauss": npy["has_gauss"], "gauss": npy["gauss"]})
    restored.append("numpy")
    torch.set_rng_state(_bytes_tensor(states["torch"]))
    restored.append("torch")
    state = _cuda_state(states.get("cuda"), cuda)
    if state is not None and cuda:
        # The saved rank's GPU state goes to this rank's GPU (the device index may differ:
        # another node, another number of GPUs per node).
        torch.cuda.set_rng_state(_bytes_tensor(state), torch.cuda.current_device())
        restored.append("cuda")
    tracker = states.get("megatron_tracker") or {}
    if tracker:
        _tracker().set_states({name: _bytes_tensor(s) for name, s in tracker.items()})
        restored.append("megatron tracker")
    return restored


def _cuda_state(saved: Any, cuda: bool) -> Optional[str]:
    """The saved rank's own CUDA generator state, from ``{"device", "state"}``. An older
    file holds a list of every device's states: its entry at this rank's device index."""
    if not saved:
        return None
    if isinstance(saved, dict):
        return saved.get("state")
    index = torch.cuda.current_device() if cuda else 0
    return saved[index] if index < len(saved) else None


def save(folder: str, rank: int, cuda: bool) -> str:
    """Write this rank's RNG file (fsynced by the commit's seal)."""
    path = rank_file(folder, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = {"rank": rank, "layout": layout(), "states": capture(cuda)}
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh)
    return path


def choose(saved_layouts: Dict[int, Dict[str, int]], mine: Dict[str, int]
           ) -> Tuple[Optional[int], str]:
    """Which saved rank's RNG file this rank restores: (rank, note) or (None, why not)."""
    any_saved = next(iter(saved_layouts.values()), None)
    if any_saved is None:
        return None, "the checkpoint holds no RNG states"
    if (any_saved["tp_size"], any_saved["pp_size"]) != (mine["tp_size"], mine["pp_size"]):
        return None, (f"the tensor/pipeline-parallel sizes changed (checkpoint TP "
                      f"{any_saved['tp_size']} x PP {any_saved['pp_size']}, now TP "
                      f"{mine['tp_size']} x PP {mine['pp_size']}), so no saved stream "
                      f"belongs to this rank")
    same_place = {r: lay for r, lay in saved_layouts.items()
                  if (lay["tp_rank"], lay["pp_rank"]) == (mine["tp_rank"], mine["pp_rank"])}
    for r, lay in sorted(same_place.items()):
        if lay["dp_rank"] == mine["dp_rank"]:
            return r, ""
    for r, lay in sorted(same_place.items()):
        if lay["dp_rank"] == 0:
            return r, (f"data-parallel rank {mine['dp_rank']} was not in the checkpoint; "
                       f"took data-parallel rank 0's state")
    return None, "no saved RNG state matches this rank's tensor/pipeline position"


def load(folder: str, rank: int) -> Dict[str, Any]:
    """The saved states of ``rank``; a damaged file is a ValueError naming it."""
    path = rank_file(folder, rank)
    try:
        with open(path, encoding="utf-8") as fh:
            states = json.load(fh)["states"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{os.path.relpath(path, folder)}: {err}") from None
    if not isinstance(states, dict):
        raise ValueError(f"{os.path.relpath(path, folder)}: 'states' is not a JSON object")
    return states
