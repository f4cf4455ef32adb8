"""Helpers to declare a flag once (default, help line, accepted values), convert its values
and freeze a group of them."""

from __future__ import annotations

import math
import typing
from dataclasses import MISSING, Field, FrozenInstanceError, field, fields
from typing import Any, List, Optional, Sequence

from ..errors import ArgumentError


class Range:
    """The values a number flag accepts: a lower and an upper bound, each included or not.
    Every float flag is also finite (nan, inf and -inf are refused) unless declared with
    ``flag(..., allow_inf=True)``."""

    def __init__(self, low: Optional[float] = None, high: Optional[float] = None, *,
                 low_open: bool = False, high_open: bool = False, words: str = ""):
        self.low, self.high = low, high
        self.low_open, self.high_open = low_open, high_open
        self.words = words

    def __contains__(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (
                value >= self.high if self.high_open else value > self.high):
            return False
        return True

    def bound(self) -> str:
        """'> 0', '>= 0', 'in [0, 1)', ..."""
        if self.low is not None and self.high is not None:
            return (f"in {'(' if self.low_open else '['}{_num(self.low)}, "
                    f"{_num(self.high)}{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_num(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {_num(self.high)}"
        return "any number"

    def __str__(self) -> str:
        return f"{self.bound()} ({self.words})" if self.words else self.bound()


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


POSITIVE = Range(0, low_open=True, words="a positive number")
NON_NEGATIVE = Range(0, words="zero or a positive number")
FRACTION = Range(0, 1, high_open=True)  # [0, 1): dropout, Adam's betas, a held-out share
NONZERO_FRACTION = Range(0, 1, low_open=True)  # (0, 1]


def flag(default: Any, help: str, choices: Sequence[Any] | None = None,
         range: Range | None = None, allow_inf: bool = False, comma_separated: bool = False,
         **kwargs) -> Any:
    """A dataclass field that is also a command-line flag of the same name. ``choices``:
    the accepted values (of each item, for a list flag); ``range``: the accepted numbers
    (checked by check_flags, shown in --help and docs/cli.md); ``allow_inf``: a float flag
    that accepts inf and -inf; ``comma_separated``: a list flag whose items may also be
    given as 'a,b,c'."""
    metadata = {"help": help}
    if comma_separated:
        metadata["comma_separated"] = True
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if range is not None:
        metadata["range"] = range
    if allow_inf:
        metadata["allow_inf"] = True
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
        if f.metadata.get("comma_separated"):
            items = [part for item in items for part in str(item).replace(",", " ").split()]
        return [_coerce_one(f.name, kind, v) for v in items]
    return _coerce_one(f.name, kind, value)


def field_default(f: Field) -> Any:
    """The default a flag's dataclass field declares."""
    return f.default if f.default is not MISSING else f.default_factory()  # type: ignore


def check_flags(group) -> None:
    """Converts every field of a flag dataclass to its type, in place, and checks the values
    of fields declared with choices, the range of numbers, and that every float is finite.
    Raises ArgumentError naming the flag, what it accepts and the value."""
    for f in fields(group):
        value = coerce(f, getattr(group, f.name))
        setattr(group, f.name, value)
        choices = f.metadata.get("choices")
        items = value if isinstance(value, list) else [value]
        for item in items:
            if choices and item is not None and item not in choices:
                raise ArgumentError(
                    f"--{f.name} must be one of {', '.join(map(str, choices))}; got {item!r}")
        check_number(f, value)


def check_number(f: Field, value: Any) -> None:
    """A float flag's value (each item of a list) is finite and in the flag's range."""
    kind, _ = base_type(f)
    accepted: Optional[Range] = f.metadata.get("range")
    items = value if isinstance(value, list) else [value]
    for item in items:
        if item is None or not isinstance(item, (int, float)) or isinstance(item, bool):
            continue
        if kind is float and not math.isfinite(item) and not (
                f.metadata.get("allow_inf") and math.isinf(item)):
            where = f" {accepted.bound()}" if accepted is not None else ""
            raise ArgumentError(f"--{f.name} must be a finite number{where}, got {item!r}")
        if accepted is not None and item not in accepted:
            raise ArgumentError(f"--{f.name} must be {accepted}, got {item!r}")


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
