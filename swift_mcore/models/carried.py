"""What a checkpoint records of the multimodal folder its language model came from (the
folder, its model_type, and a fingerprint of each tensor the model does not hold: the vision
tower an export copies from that folder), and what differs in the folder now.

Each carried tensor is fingerprinted by its dtype, shape and the sha256 of its bytes as the
safetensors file stores them. The bytes, not the headers: a sibling checkpoint of the same
model (a base and its instruct version, a vision tower finetuned in place) has the very same
names, dtypes, shapes and file sizes, and only the bytes tell it apart. The cost is one read
of the carried tensors (the vision tower: a few percent of a model's weights), which the
export reads to copy anyway.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, List, Optional

# safetensors' own limit on a header's size
MAX_HEADER = 100 << 20
CHUNK = 16 << 20
_RECORDS: Dict[str, Optional[Dict[str, Any]]] = {}


def record(path: Optional[str]) -> Optional[Dict[str, Any]]:
    """The record of the multimodal Hugging Face folder ``path``; None when ``path`` is no
    such folder. Computed once per process and folder: a run records the folder as it was
    at its first save (or as the checkpoint it continues recorded it: ``inherit``)."""
    from .hf_folder import is_hf_folder

    if not path or not is_hf_folder(path):
        return None
    path = os.path.abspath(path)
    if path not in _RECORDS:
        _RECORDS[path] = current(path)
    return _RECORDS[path]


def inherit(saved: Optional[Dict[str, Any]], path: Optional[str]) -> None:
    """A run that continues a checkpoint (resume, --load --finetune) from the same folder
    records what that checkpoint recorded: the folder as it was when the first run of the
    line saved, so a change since then is still seen at export."""
    if isinstance(saved, dict) and path and saved.get("folder") == os.path.abspath(path):
        _RECORDS[os.path.abspath(path)] = saved


def current(path: str) -> Optional[Dict[str, Any]]:
    """The record of the folder ``path`` as it is now (None: not a multimodal folder)."""
    from .hf_folder import HFFolder
    from .text_part import carried, is_multimodal, part_of

    folder = HFFolder(path, flag="the source folder")
    if not is_multimodal(folder.config):
        return None
    part = part_of(folder)
    names = {name for name, _ in carried(folder, part)}
    by_file: Dict[str, List[str]] = {}
    for name in sorted(names):
        by_file.setdefault(folder.weight_map[name], []).append(name)
    tensors = {}
    for file, in_file in by_file.items():
        tensors.update(_fingerprints(file, in_file))
    return {"folder": folder.path, "model_type": folder.config["model_type"],
            "carried": dict(sorted(tensors.items()))}


def _fingerprints(path: str, names: List[str]) -> Dict[str, str]:
    """name -> "DTYPE [shape] sha256:HEX" of the tensors ``names`` of one safetensors file."""
    from ..errors import ArgumentError
    from ..input_files import open_regular

    with open_regular(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        length = int.from_bytes(fh.read(8), "little")
        if length > min(MAX_HEADER, size - 8):
            raise ArgumentError(f"the source folder's {path}: not a safetensors file (its "
                                f"header length {length} exceeds the file)")
        header = json.loads(fh.read(length))
        start = 8 + length
        out = {}
        for name in names:
            entry = header[name]
            begin, end = entry["data_offsets"]
            digest = hashlib.sha256()
            fh.seek(start + begin)
            left = end - begin
            while left > 0:
                data = fh.read(min(CHUNK, left))
                if not data:
                    raise ArgumentError(f"the source folder's {path} is cut short (reading "
                                        f"{name})")
                digest.update(data)
                left -= len(data)
            out[name] = f"{entry['dtype']} {list(entry['shape'])} sha256:{digest.hexdigest()}"
    return out


def malformed(saved: Any) -> bool:
    """Whether a run.json's record is not one ``record`` writes."""
    return not (isinstance(saved, dict) and isinstance(saved.get("folder"), str)
                and os.path.isabs(saved["folder"]) and isinstance(saved.get("model_type"), str)
                and isinstance(saved.get("carried"), dict)
                and all(isinstance(v, str) for v in saved["carried"].values()))


def differences(saved: Dict[str, Any]) -> Optional[str]:
    """What differs between the folder ``saved`` (not ``malformed``) recorded and that
    folder now, in words; None when it is the same."""
    from ..errors import ArgumentError
    from .hf_folder import is_hf_folder

    path = saved["folder"]
    if not os.path.isdir(path):
        return f"{path} no longer exists"
    if not is_hf_folder(path):
        return f"{path} is no longer a Hugging Face folder (no config.json)"
    try:
        now = current(path)
    except ArgumentError as err:  # its weights unreadable now
        return f"{path} cannot be read ({err})"
    if now is None:
        return f"{path} is no longer a multimodal {saved.get('model_type')} folder"
    if now["model_type"] != saved.get("model_type"):
        return (f"{path} is now a {now['model_type']} folder, not "
                f"{saved.get('model_type')}")
    then, nowt = saved.get("carried") or {}, now["carried"]
    gone = sorted(set(then) - set(nowt))
    new = sorted(set(nowt) - set(then))
    changed = sorted(n for n in set(then) & set(nowt) if then[n] != nowt[n])
    if not (gone or new or changed):
        return None
    parts = []
    for what, names in (("missing now", gone), ("new", new), ("changed", changed)):
        if names:
            first = names[0]
            if what == "changed":
                was, now_is = then[first].rsplit(" ", 1)[0], nowt[first].rsplit(" ", 1)[0]
                first += f" ({was} then, {now_is} now)" if was != now_is else " (its values)"
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            parts.append(f"{what}: {first}{more}")
    return (f"the tensors of {path} the language model did not train differ from those at "
            f"training ({'; '.join(parts)})")
