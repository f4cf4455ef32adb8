"""A Hugging Face model folder on disk: config.json, its safetensors weights (read lazily,
slice by slice) and what is wrong with it, named by file and key."""

from __future__ import annotations

import glob
import os
from typing import Any, Dict, Optional, Tuple

from ..errors import ArgumentError
from ..input_files import check_regular, inside, load_json

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Buffers some exporters save that no model parameter corresponds to.
IGNORABLE_SUFFIXES = (".rotary_emb.inv_freq",)


def is_hf_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG))


class HFFolder:
    """Checks on construction that the folder, config.json and the weight files exist (no
    tensor is read). ``flag`` names the option the path came from in error messages."""

    def __init__(self, path: str, flag: str = "--model"):
        self.flag = flag
        self.path = os.path.abspath(os.path.expanduser(path))
        if not os.path.exists(self.path):
            raise ArgumentError(f"{flag} {path}: no such folder (swift-mcore reads local "
                                f"Hugging Face folders; download the model first)")
        if not os.path.isdir(self.path):
            raise ArgumentError(f"{flag} {path} is a file; give the Hugging Face model folder "
                                f"that holds config.json and *.safetensors")
        self.config_path = os.path.join(self.path, CONFIG)
        if not os.path.isfile(self.config_path):
            hint = (" (it looks like a swift-mcore checkpoint: train from it with --load PATH "
                    "--finetune, or export it with `swift-mcore export --to_hf`)"
                    if _looks_like_checkpoint(self.path) else "")
            raise ArgumentError(f"{flag} {path}: no config.json in {self.path}; expected a "
                                f"Hugging Face model folder{hint}")
        self.config: Dict[str, Any] = load_json(self.config_path)
        if not isinstance(self.config, dict):
            raise ArgumentError(f"{self.config_path} must hold a JSON object")
        self.files = self._weight_files()
        self._weight_map: Optional[Dict[str, str]] = None

    # ---- which files hold the weights ----------------------------------------------------
    def _weight_files(self) -> Tuple[str, ...]:
        index = os.path.join(self.path, INDEX)
        if os.path.isfile(index):
            document = load_json(index)
            weight_map = document.get("weight_map") if isinstance(document, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise ArgumentError(f"{index} is not a safetensors index (no \"weight_map\" "
                                    f"object of tensor name -> file)")
            # the index's file names stay inside the folder (no ../, no absolute paths)
            paths = {k: inside(self.path, v, f"{index}: {k}") for k, v in weight_map.items()}
            files = sorted(set(paths.values()))
            missing = [os.path.relpath(f, self.path) for f in files if not os.path.exists(f)]
            if missing:
                raise ArgumentError(f"{index} names weight files that are missing: "
                                    f"{', '.join(missing)}")
            for path in files:
                check_regular(path, f"{self.flag} {path}")
            self._index_map = paths
            return tuple(files)
        self._index_map = None
        files = sorted(glob.glob(os.path.join(self.path, "*.safetensors")))
        for path in files:  # a FIFO would block the reader, a device never end
            check_regular(path, f"{self.flag} {path}")
        if files:
            return tuple(files)
        others = sorted(os.path.basename(p) for ext in ("bin", "pt", "pth", "gguf")
                        for p in glob.glob(os.path.join(self.path, f"*.{ext}")))
        if others:
            raise ArgumentError(
                f"{self.flag} {self.path} has weights only as {', '.join(others[:3])}; "
                f"swift-mcore reads safetensors (convert once with transformers: "
                f"AutoModelForCausalLM.from_pretrained(p).save_pretrained(p))")
        raise ArgumentError(f"{self.flag} {self.path} has config.json but no weights (no "
                            f"{SINGLE}, {INDEX} or *.safetensors)")

    @property
    def weight_map(self) -> Dict[str, str]:
        """tensor name -> file; reads only the safetensors headers."""
        if self._weight_map is None:
            if self._index_map is not None:
                self._weight_map = dict(self._index_map)
            else:
                self._weight_map = {}
                for path in self.files:
                    with self.open(path) as fh:
                        for key in fh.keys():
                            self._weight_map[key] = path
        return self._weight_map

    def open(self, path: str):
        """safetensors' reader of one weight file (a context manager); a file it cannot
        read (truncated, not safetensors) is one ArgumentError naming the file."""
        from safetensors import safe_open

        check_regular(path, f"{self.flag} {path}")
        try:
            return safe_open(path, framework="pt")
        except Exception as err:  # SafetensorError, OSError, ...: the library's, unnamed
            raise unreadable(self.flag, path, err) from None

    def shapes(self) -> Dict[str, Tuple[Tuple[int, ...], str]]:
        """tensor name -> (shape, file), from the headers only."""
        out = {}
        by_file: Dict[str, list] = {}
        for name, path in self.weight_map.items():
            by_file.setdefault(path, []).append(name)
        for path, names in by_file.items():
            with self.open(path) as fh:
                present = set(fh.keys())
                for name in names:
                    if name not in present:
                        raise ArgumentError(f"{os.path.join(self.path, INDEX)} places {name} in "
                                            f"{os.path.basename(path)}, which does not hold it")
                    out[name] = (tuple(fh.get_slice(name).get_shape()), path)
        return out

    def float32_names(self) -> frozenset:
        """The tensors its files hold in float32, from the headers only."""
        by_file: Dict[str, list] = {}
        for name, path in self.weight_map.items():
            by_file.setdefault(path, []).append(name)
        out = set()
        for path, names in by_file.items():
            with self.open(path) as fh:
                present = set(fh.keys())
                out.update(name for name in names
                           if name in present and fh.get_slice(name).get_dtype() == "F32")
        return frozenset(out)

    def reader(self) -> "Reader":
        return Reader(self)


class Reader:
    """``read(name, rows, cols)``: a slice of one tensor, read from disk without loading the
    rest (safetensors memory-maps the file). Use as a context manager.

    One file is open at a time: the pages of a memory-mapped file that were read count in the
    process's resident memory until it is closed, so keeping every shard open would hold the
    whole folder in RSS by the end of a conversion. Readers go through the tensors mostly in
    file order, so a file is rarely opened twice. Within a file, the mapping is dropped and
    made again once ``remap_bytes`` were read through it: a shard is commonly 500 MB to
    5 GB, and its pages read so far would otherwise sit in resident memory beside the model
    they were copied into."""

    remap_bytes = 16 * 2**20

    def __init__(self, folder: HFFolder):
        self.folder = folder
        self._handles: Dict[str, Any] = {}
        self._read_through = 0  # bytes read through the open mapping

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()
        self._read_through = 0

    def read(self, name: str, rows: Optional[slice] = None, cols: Optional[slice] = None):
        path = self.folder.weight_map.get(name)
        if path is None:
            raise ArgumentError(f"{self.folder.flag} {self.folder.path}: the weights have no "
                                f"tensor {name}")
        handle = self._handles.get(path)
        if handle is None:
            self.__exit__(None, None, None)
            handle = self.folder.open(path).__enter__()
            self._handles[path] = handle
        try:
            part = handle.get_slice(name)
            if rows is None and cols is None:
                value = part[:]
            elif cols is None:
                value = part[rows]
            else:
                value = part[rows if rows is not None else slice(None), cols]
        except Exception as err:  # a file cut short after its header, ...
            raise unreadable(self.folder.flag, path, err, name) from None
        self._read_through += value.numel() * value.element_size()
        if self._read_through >= self.remap_bytes:
            self.__exit__(None, None, None)  # the next read maps the file afresh
        return value


def unreadable(flag: str, path: str, err: Exception, tensor: Optional[str] = None
               ) -> ArgumentError:
    """One line for a weight file the safetensors library could not read."""
    lines = str(err).strip().splitlines()
    reason = f"{type(err).__name__}: {lines[0][:300]}" if lines else type(err).__name__
    what = f" (reading {tensor})" if tensor else ""
    return ArgumentError(f"{flag} {path}: not a readable safetensors file{what} ({reason})")


def _looks_like_checkpoint(path: str) -> bool:
    names = set(os.listdir(path))
    return bool(names & {"latest_checkpointed_iteration.txt", "metadata.json", "manifest.json",
                         "checkpoint"}) or any(n.startswith("iter_") for n in names)
