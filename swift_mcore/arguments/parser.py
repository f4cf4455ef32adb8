"""Command line and YAML -> RunArguments or SftArguments: YAML first, flags override it."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import Field, fields
from typing import Optional, Sequence

import yaml

from ..errors import ArgumentError
from .fields import base_type
from .run import RunArguments, flag_default


def _describe_default(f: Field, cls=None) -> str:
    default = flag_default(cls, f)
    return "none" if default is None else str(default)


def build_parser(prog: str = "swift-mcore pt", description: str = "",
                 cls=RunArguments) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=description, argument_default=argparse.SUPPRESS,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="YAML file of flags; flags given on the "
                        "command line override it.")
    for group_name, group_type in cls.GROUPS.items():
        add_flags(parser.add_argument_group(group_name), group_type, cls)
    return parser


def add_flags(group, dataclass_type, cls=None) -> None:
    """One ``--name`` per field of ``dataclass_type``, typed and documented from its metadata
    (defaults as the command ``cls`` sets them)."""
    for f in fields(dataclass_type):
        kind, is_list = base_type(f)
        help_text = f"{f.metadata['help']} (default: {_describe_default(f, cls)})"
        if "choices" in f.metadata:
            help_text += f" [choices: {', '.join(map(str, f.metadata['choices']))}]"
        if "range" in f.metadata:
            help_text += f" [{f.metadata['range'].bound()}]"
        # argparse %-formats help strings: a literal % ("13% faster") would crash --help
        kwargs = dict(dest=f.name, help=help_text.replace("%", "%%"))
        if kind is bool:
            # `--flag` alone means true; `--flag false` is accepted too (ms-swift style).
            kwargs.update(nargs="?", const="true", metavar="BOOL")
        elif is_list:
            kwargs.update(nargs="+", metavar=kind.__name__.upper())
        else:
            kwargs.update(metavar=kind.__name__.upper())
        if f.name == "resume":
            kwargs.update(nargs="?", const="auto", metavar="PATH")
        group.add_argument(f"--{f.name}", **kwargs)


def parse_args(argv: Optional[Sequence[str]] = None, prog: str = "swift-mcore pt",
               cls=RunArguments) -> RunArguments:
    parser = build_parser(prog, cls=cls)
    ns = parser.parse_args(list(argv) if argv is not None else None)
    values = vars(ns)
    config = values.pop("config", None)
    try:
        flags = load_yaml(config, cls) if config else {}
    except ArgumentError as err:
        raise _second_value(parser, argv, config, err) from None
    flags.update(values)
    return cls.from_flags(**flags)


def _second_value(parser, argv, config: str, err: ArgumentError) -> ArgumentError:
    """``err`` of a config file that is a second value given to a one-value flag (two
    --cached_dataset folders): named so, not as a config file the user never meant."""
    words = list(argv) if argv is not None else sys.argv[1:]
    if config in words and (os.path.isdir(config) or not os.path.lexists(config)):
        i = words.index(config)
        action = parser._option_string_actions.get(words[i - 2]) if i >= 2 else None
        if action is not None and action.nargs is None and not words[i - 1].startswith("-"):
            return ArgumentError(f"{words[i - 2]} takes one value ({words[i - 1]}); the next "
                                 f"word, {config}, was read as a config file: {err}")
    return err


def load_yaml(path: str, cls=RunArguments) -> dict:
    import stat

    try:
        # a FIFO or device would block open() or never end (input_files.py, not importable
        # from this ground floor, does the same for every other input)
        if os.path.exists(path) and not os.path.isdir(path) and not stat.S_ISREG(
                os.stat(path).st_mode):
            raise ArgumentError(f"config file {path} is not a regular file; give a YAML "
                                f"file of flags")
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
    except FileNotFoundError:
        raise ArgumentError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ArgumentError(f"config file {path} is a folder; give a YAML file of flags "
                            f"(see `swift-mcore {cls.COMMAND} --help`)") from None
    except OSError as err:
        raise ArgumentError(f"config file {path} cannot be read ({err.strerror or err})"
                            ) from None
    except UnicodeDecodeError as err:
        raise ArgumentError(f"config file {path} is not a text (UTF-8) YAML file ({err})"
                            ) from None
    except yaml.YAMLError as err:
        text = " ".join(str(err).split())
        raise ArgumentError(f"config file {path} is not valid YAML: {text}") from None
    except RecursionError:
        raise ArgumentError(f"config file {path} nests too deeply to be a file of flags"
                            ) from None
    if not isinstance(data, dict):
        raise ArgumentError(f"config file {path} must map flag names to values")
    known = {f.name for t in cls.GROUPS.values() for f in fields(t)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ArgumentError(f"config file {path}: unknown key(s) {', '.join(unknown)}; "
                            f"see `swift-mcore {cls.COMMAND} --help`")
    return data

