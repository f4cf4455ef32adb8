"""Helpers to declare a flag once (default, help line, accepted values), convert its values
and freeze a group of them."""

from __future__ import annotations

import typing
from dataclasses import MISSING, Field, FrozenInstanceError, field, fields
from typing import Any, List, Sequence

from ..errors import ArgumentError


def flag(default: Any, help: str, choices: Sequence[Any] | None = None, **kwargs) -> Any:
    """A dataclass field that is also a command-line flag of the same name."""
    metadata = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata, **kwargs)
    return field(default=default, metadata=metadata, **kwargs)


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def base_type(f: Field):
    """(python type, is_list) for a field annotated like Optional[List[int]]."""
    hint = f.type
    if isinstance(hint, str):  # postponed annotations: the groups use only these names
        hint = eval(hint, {"Optional": typing.Optional, "List": List, "int": int,
                           "float": float, "str": str, "bool": bool})
    is_list = False
    while True:
        origin = typing.get_origin(hint)
        if origin is typing.Union:
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        elif origin in (list, List):
            is_list = True
            hint = typing.get_args(hint)[0]
        else:
            return hint, is_list


def _to_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ArgumentError(f"--{name} takes true or false, got {value!r}")


def coerce(f: Field, value: Any) -> Any:
    """Convert a value from YAML, the command line or Python into the field's type."""
    if value is None:
        return None
    kind, is_list = base_type(f)
    if is_list:
        items = value if isinstance(value, (list, tuple)) else str(value).split()
        return [_coerce_one(f.name, kind, v) for v in items]
    return _coerce_one(f.name, kind, value)


def field_default(f: Field) -> Any:
    """The default a flag's dataclass field declares."""
    return f.default if f.default is not MISSING else f.default_factory()  # type: ignore


def check_flags(group) -> None:
    """Converts every field of a flag dataclass to its type, in place, and checks the values
    of fields declared with choices. Raises ArgumentError naming the flag."""
    for f in fields(group):
        value = coerce(f, getattr(group, f.name))
        setattr(group, f.name, value)
        choices = f.metadata.get("choices")
        if choices and value is not None and value not in choices:
            raise ArgumentError(
                f"--{f.name} must be one of {', '.join(map(str, choices))}; got {value!r}")


def _coerce_one(name: str, kind, value):
    if kind is bool:
        return _to_bool(name, value)
    if kind is int:
        if isinstance(value, bool):
            raise ArgumentError(f"--{name} takes an integer, got {value!r}")
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(str(value))
        except ValueError:
            raise ArgumentError(f"--{name} takes an integer, got {value!r}") from None
    if kind is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ArgumentError(f"--{name} takes a number, got {value!r}") from None
    return str(value)




_FROZEN_TYPES: dict = {}


def _refuse(self, name, value=None):
    raise FrozenInstanceError(
        f"cannot set {type(self).__name__}.{name}: a resolved run's flags are read-only "
        f"(change the arguments and resolve again)")


def freeze(obj, nested=()):
    """Make the dataclass ``obj`` (and its attributes named in ``nested``) read-only in place:
    assignments raise FrozenInstanceError, lists become tuples. Returns ``obj``."""
    for name in nested:
        freeze(getattr(obj, name))
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, list):
            object.__setattr__(obj, f.name, tuple(value))
        elif isinstance(value, (set, dict)):
            object.__setattr__(obj, f.name, frozenset(value) if isinstance(value, set)
                               else dict(value))
    cls = type(obj)
    if cls not in _FROZEN_TYPES.values():
        if cls not in _FROZEN_TYPES:
            _FROZEN_TYPES[cls] = type(cls.__name__, (cls,), {
                "__setattr__": _refuse, "__delattr__": _refuse, "__module__": cls.__module__,
                "__qualname__": cls.__qualname__})
        obj.__class__ = _FROZEN_TYPES[cls]
    return obj
