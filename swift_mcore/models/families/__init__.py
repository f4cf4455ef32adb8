"""The model-family registry: finds the family of a Hugging Face config.json and applies it
to ModelArguments, so that validation, the resume check and the model builder all see the
config's values.

A family is one module in this package that defines ``FAMILY`` (see llama.py); it is found
by ``model_type`` (then by ``architectures``) and registered on import, nothing else to edit.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from typing import Any, Dict, List, Optional

from ...errors import ArgumentError
from .base import Family, InvalidConfig, UnsupportedConfig, canonical_config

logger = logging.getLogger("swift_mcore")

_FAMILIES: Dict[str, Family] = {}
# Values config.json suggests that an explicit flag may change (finetuning choices).
TRAINING_KEYS = frozenset({"moe_aux_loss_coeff"})
_warned: set = set()


def families() -> Dict[str, Family]:
    """name -> Family, every module of this package that defines FAMILY (sorted by name)."""
    if not _FAMILIES:
        for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
            module = importlib.import_module(f"{__name__}.{info.name}")
            family = getattr(module, "FAMILY", None)
            if isinstance(family, Family):
                _FAMILIES[family.name] = family
    return _FAMILIES


def by_name(name: str, flag: str = "--model_type") -> Family:
    try:
        return families()[name]
    except KeyError:
        raise ArgumentError(f"{flag} {name!r} is not a supported model family; choose one of "
                            f"{', '.join(families())}") from None


def for_config(config: Dict[str, Any], source: str) -> Family:
    """The family of a config.json, by model_type, else by its architectures."""
    model_type = config.get("model_type")
    for family in families().values():
        if model_type in family.model_types:
            return family
    architectures = config.get("architectures") or []
    for family in families().values():
        if family.architecture in architectures:
            return family
    supported = ", ".join(f"{f.name} ({f.architecture})" for f in families().values())
    raise ArgumentError(
        f"{source}: model_type {model_type!r} (architectures {architectures}) is not supported; "
        f"supported families: {supported}. docs/models.md says how to add one.")


def for_model_args(m: Any) -> Family:
    """The family to export ModelArguments ``m`` as: --model_type when set, else the first
    family whose fixed traits match the flags (a model trained from scratch). Raises
    ArgumentError naming the flags no family can express."""
    if m.model_type:
        candidates = [by_name(m.model_type)]
    else:
        candidates = list(families().values())
    problems: List[str] = []
    for family in candidates:
        found = family.representation_problems(m)
        if not found:
            return family
        if not problems or len(found) < len(problems):
            problems = found
    which = f"a {m.model_type} model" if m.model_type else "any supported family"
    raise ArgumentError(f"this model cannot be written as {which} on Hugging Face: "
                        f"{'; '.join(problems)}")


def apply_hf_config(args) -> Optional[Family]:
    """Set the model flags from --model's config.json (or --model_type's fixed traits).

    A flag given explicitly (command line, YAML or from_flags) that disagrees with the
    config is an error naming both values; make_vocab_size_divisible_by becomes 1 unless
    given, so the embedding has exactly the checkpoint's rows. Idempotent.
    """
    from ..hf_folder import HFFolder

    m, explicit = args.model, args.explicit
    if not m.model:
        if not m.model_type:
            return None
        family = by_name(m.model_type)
        _apply(m, family.fixed, explicit, f"--model_type {m.model_type}")
        return family
    folder = HFFolder(m.model, flag="--model")
    family = for_config(folder.config, folder.config_path)
    if m.model_type and "model_type" in explicit and m.model_type != family.name:
        raise ArgumentError(f"--model_type {m.model_type!r} disagrees with {folder.config_path} "
                            f"(a {family.name} model); drop --model_type")
    try:
        config = canonical_config(family, folder.config)
        values = family.model_values(config, m)
    except InvalidConfig as err:
        raise ArgumentError(f"--model {m.model}: {folder.config_path} has values no "
                            f"{family.name} model has: {err}") from None
    except UnsupportedConfig as err:
        raise ArgumentError(f"--model {m.model}: {folder.config_path} describes a "
                            f"{family.name} model swift-mcore cannot represent exactly: "
                            f"{err}") from None
    # router_aux_loss_coef is a training setting, not the model's shape: a flag wins.
    values = {k: v for k, v in values.items() if not (k in TRAINING_KEYS and k in explicit)}
    _apply(m, values, explicit, f"{folder.config_path} (--model)")
    if "make_vocab_size_divisible_by" not in explicit:
        m.make_vocab_size_divisible_by = 1
    unknown = family.unknown_keys(config)
    if unknown and folder.config_path not in _warned:
        _warned.add(folder.config_path)
        logger.warning("%s: keys not interpreted by the %s family (assumed to change nothing "
                       "in the model): %s", folder.config_path, family.name, ", ".join(unknown))
    return family


def _apply(m: Any, values: Dict[str, Any], explicit, source: str) -> None:
    conflicts = [f"--{name} {getattr(m, name)!r} (the config says {value!r})"
                 for name, value in values.items()
                 if name in explicit and getattr(m, name) != value]
    if conflicts:
        raise ArgumentError(f"{source} sets the model's shape, and these flags disagree with "
                            f"it: {'; '.join(conflicts)}. Drop them.")
    for name, value in values.items():
        setattr(m, name, value)


__all__ = ["Family", "UnsupportedConfig", "apply_hf_config", "by_name", "families",
           "for_config", "for_model_args"]
