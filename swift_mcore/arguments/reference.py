"""Renders the CLI reference (docs/cli.md) from the argument dataclasses."""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import List

from .pretrain import _GROUP_TYPES

HEADER = """# CLI reference: `swift-mcore pt`

Generated from the argument dataclasses in `swift_mcore/arguments/` by
`python -m swift_mcore.arguments.reference > docs/cli.md`; a test fails when it is stale.

Flags are snake_case. A YAML file given as the first argument sets any of them; flags on
the command line override it. Boolean flags take `--flag` alone (true) or `--flag false`.
From Python: `PretrainArguments.from_flags(lr=1e-4, num_layers=8)`.
"""


def render() -> str:
    lines = [HEADER]
    for group_name, group_type in _GROUP_TYPES.items():
        lines.append(f"\n## {group_name} (`{group_type.__name__}`)\n")
        lines.extend(flag_table(group_type))
    for command, dataclass_type in other_commands():
        lines.append(f"\n## `swift-mcore {command}` (`{dataclass_type.__name__}`)\n")
        lines.extend(flag_table(dataclass_type))
    return "\n".join(lines) + "\n"


def other_commands():
    """(command, its argument dataclass) for the commands besides pt."""
    from .export import ExportArguments
    from .infer import InferArguments

    return [("export", ExportArguments), ("infer", InferArguments)]


def flag_table(dataclass_type) -> List[str]:
    """The markdown table (flag, default, description) of one argument dataclass."""
    lines = ["| flag | default | description |", "| --- | --- | --- |"]
    for f in fields(dataclass_type):
        default = f.default if f.default is not MISSING else f.default_factory()
        shown = "none" if default is None else f"`{default}`"
        text = f.metadata["help"]
        if "choices" in f.metadata:
            text += " One of: " + ", ".join(f"`{c}`" for c in f.metadata["choices"]) + "."
        lines.append(f"| `--{f.name}` | {shown} | {text.replace('|', '/')} |")
    return lines


if __name__ == "__main__":
    print(render(), end="")
