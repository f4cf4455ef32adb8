"""The language model inside a multimodal Hugging Face folder (Qwen3.5 ``qwen3_5`` /
``qwen3_5_moe``, Gemma 3 ``gemma3``), trained on text alone: where its tensors are in the
files, its config.json (text_config), and the tensors it does not hold (the vision tower
and its projector), which an export copies from the source folder unchanged.

The files name the language model's ``model.*`` tensors ``model.language_model.*``
(transformers 5) or ``language_model.model.*`` (the Hub's first Gemma 3 folders, whose head
is then ``language_model.lm_head.weight``); Qwen3.5's ``mtp.*`` and ``lm_head.weight`` keep
their names. Everything else in the files is carried.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

# model_type of the multimodal folders whose language model a family trains alone
MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "gemma3")
# (the files' name of the text model's "model.", of its lm_head.weight)
SPELLINGS = (("model.language_model.", "lm_head.weight"),
             ("language_model.model.", "language_model.lm_head.weight"))
# top-level config.json keys of these folders that leave the language model's output as is
# (image token ids, the vision side's initialization)
TOP_KEYS = frozenset({"text_config", "vision_config", "image_token_id", "video_token_id",
                      "vision_start_token_id", "vision_end_token_id", "mm_tokens_per_image",
                      "boi_token_index", "eoi_token_index", "image_token_index",
                      "initializer_range", "tie_word_embeddings"})


def is_multimodal(config: Dict[str, Any]) -> bool:
    """Whether a config.json is one of MODEL_TYPES' multimodal folders (text_config)."""
    return config.get("model_type") in MODEL_TYPES and "text_config" in config


def language_config(config: Dict[str, Any]) -> Dict[str, Any]:
    """The language model's config.json: text_config, with the top level's
    tie_word_embeddings (transformers ties the head by the top level's)."""
    text = dict(config.get("text_config") or {})
    if config.get("tie_word_embeddings") is not None:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    return text


def language_model_values(config: Dict[str, Any], model_args: Any, model_values) -> Dict[str, Any]:
    """A family's ``model_values`` for a multimodal folder's config.json: those of its language
    model (text_config), after the top level is checked and, when --model names a folder, its
    files are found to hold the language model; a refusal names text_config."""
    from .families.base import InvalidConfig, UnsupportedConfig

    problems = top_level_problems(config)
    if problems:
        raise InvalidConfig("; ".join(problems))
    if getattr(model_args, "model", None):  # its files name the language model
        open_folder(model_args.model)
    try:
        return model_values(language_config(config), model_args)
    except UnsupportedConfig as err:  # InvalidConfig too: its class is kept
        raise type(err)(f"text_config: {err}") from None


def top_level_problems(config: Dict[str, Any]) -> List[str]:
    """The top-level keys of a multimodal config.json the language model cannot follow."""
    from .families.base import VALUES

    problems = [p for p in (VALUES[k].problem(k, config.get(k)) for k in sorted(TOP_KEYS)
                             if k in VALUES and k in config) if p]
    if not isinstance(config.get("text_config"), dict):
        problems.append(f"text_config {config.get('text_config')!r} (an object: the language "
                        f"model's config)")
    return problems


def unknown_keys(family, config: Dict[str, Any]) -> List[str]:
    """The keys of a multimodal config.json nobody reads (text_config's prefixed)."""
    from .families.base import IGNORED_KEYS

    top = sorted(k for k in config if k not in TOP_KEYS | IGNORED_KEYS)
    return top + [f"text_config.{k}" for k in family.unknown_keys(language_config(config))]


@dataclass(frozen=True)
class TextPart:
    """Where the language model's tensors are in a multimodal folder's files."""

    model: str  # the files' name of the text model's "model."
    head: str   # the files' name of lm_head.weight

    def file_name(self, name: str) -> str:
        """The files' name of the text model's tensor ``name``."""
        if name.startswith("model."):
            return self.model + name[len("model."):]
        return self.head if name == "lm_head.weight" else name

    def text_name(self, file_name: str) -> Optional[str]:
        """The text model's name of a file's tensor; None for a carried one."""
        if file_name.startswith(self.model):
            return "model." + file_name[len(self.model):]
        if file_name == self.head:
            return "lm_head.weight"
        return file_name if file_name.startswith("mtp.") else None


def part_of(folder) -> Optional[TextPart]:
    """The TextPart of an HFFolder (None: not a multimodal folder). ArgumentError when its
    files hold no language model's embedding under either spelling."""
    from ..errors import ArgumentError

    if not is_multimodal(folder.config):
        return None
    for model, head in SPELLINGS:
        if model + "embed_tokens.weight" in folder.weight_map:
            if head not in folder.weight_map and "lm_head.weight" in folder.weight_map:
                head = "lm_head.weight"  # transformers reads either name as the head
            return TextPart(model, head)
    raise ArgumentError(f"--model {folder.path}: a {folder.config['model_type']} folder whose "
                        f"weights hold no language model's embedding (looked for "
                        f"{' and '.join(m + 'embed_tokens.weight' for m, _ in SPELLINGS)})")


class TextView:
    """An HFFolder seen as its language model's folder: its config.json is text_config, its
    weights the language model's under their text-model names (the carried ones hidden)."""

    def __init__(self, folder, part: TextPart):
        self.folder, self.part = folder, part
        self.config = language_config(folder.config)

    def __getattr__(self, name: str):
        return getattr(self.folder, name)

    @property
    def weight_map(self) -> Dict[str, str]:
        return {text: path for name, path in self.folder.weight_map.items()
                if (text := self.part.text_name(name)) is not None}

    def shapes(self):
        return {text: value for name, value in self.folder.shapes().items()
                if (text := self.part.text_name(name)) is not None}

    def reader(self) -> "_TextReader":
        return _TextReader(self.folder.reader(), self.part)


class _TextReader:
    def __init__(self, reader, part: TextPart):
        self.inner, self.part = reader, part

    def __enter__(self) -> "_TextReader":
        self.inner.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.inner.__exit__(*exc)

    def read(self, name: str, rows=None, cols=None):
        return self.inner.read(self.part.file_name(name), rows, cols)


def open_folder(path: str, flag: str = "--model"):
    """The HFFolder at ``path``, or its TextView when it is a multimodal folder."""
    from .hf_folder import HFFolder

    folder = HFFolder(path, flag=flag)
    part = part_of(folder)
    return folder if part is None else TextView(folder, part)


def carried(folder, part: TextPart) -> List[Tuple[str, Tuple[int, ...]]]:
    """The tensors of an HFFolder the language model does not hold, with their shapes."""
    return [(name, tuple(shape)) for name, (shape, _) in sorted(folder.shapes().items())
            if part.text_name(name) is None]


def multimodal_config(base: Dict[str, Any], text: Dict[str, Any]) -> Dict[str, Any]:
    """The exported config.json: ``base`` (the source's) with the trained language model's
    config ``text`` as its text_config, and its tie_word_embeddings at the top."""
    text = dict(text)
    text.pop("architectures", None)
    text.pop("dtype", None)
    text["model_type"] = (base.get("text_config") or {}).get("model_type") \
        or f"{base['model_type']}_text"
    config = {k: v for k, v in base.items()
              if k not in ("text_config", "transformers_version", "dtype",
                           "torch_dtype")}
    config.update(text_config=text, tie_word_embeddings=text.get("tie_word_embeddings",
                                                                   False))
    return config
