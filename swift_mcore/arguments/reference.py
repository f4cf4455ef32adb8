"""Renders the CLI reference (docs/cli.md) from the argument dataclasses."""

from __future__ import annotations

from dataclasses import fields
from typing import List

from .fields import field_default
from .run import RunArguments

HEADER = """# CLI reference: `swift-mcore pt` and `swift-mcore sft`

Generated from the argument dataclasses in `swift_mcore/arguments/` by
`python -m swift_mcore.arguments.reference > docs/cli.md`; a test fails when it is stale.

Flags are snake_case. A YAML file given as the first argument sets any of them; flags on
the command line override it. Boolean flags take `--flag` alone (true) or `--flag false`.
From Python: `RunArguments.from_flags(lr=1e-4, num_layers=8)`, or
`SftArguments.from_flags(dataset=["train.jsonl"], packing=True)`.

Flags are checked before any work starts. A float flag takes a finite number
(`nan`, `inf`, `-inf`, and YAML's `.nan`/`.inf`, are refused) in the range its row names
("Accepts: ..."); a value outside it stops the command with exit code 2 and a line naming
the flag, the range and the value.
"""


def render() -> str:
    lines = [HEADER]
    for group_name, group_type in RunArguments.GROUPS.items():
        lines.append(f"\n## {group_name} (`{group_type.__name__}`)\n")
        lines.extend(flag_table(group_type))
    lines.extend(sft_section())
    lines.extend(rlhf_section())
    for command, dataclass_type in other_commands():
        lines.append(f"\n## `swift-mcore {command}` (`{dataclass_type.__name__}`)\n")
        lines.extend(flag_table(dataclass_type))
    return "\n".join(lines) + "\n"


def sft_section() -> List[str]:
    from .sft import SftArguments, SftDataArguments

    changed = ", ".join(f"`--{name}` {value}" for name, value in SftArguments.DEFAULTS.items())
    lines = ["\n## `swift-mcore sft` (`SftArguments`)\n",
             f"Every flag above, with these defaults changed: {changed}; and the finetuning "
             f"data flags (`SftDataArguments`, docs/sft.md):\n"]
    return lines + flag_table(SftDataArguments)


def rlhf_section() -> List[str]:
    from .rlhf import RlhfArguments, RlhfGroupArguments

    changed = ", ".join(f"`--{name}` {value}" for name, value in RlhfArguments.DEFAULTS.items())
    lines = ["\n## `swift-mcore rlhf` (`RlhfArguments`)\n",
             f"Every flag of `pt` (not sft's data flags), with these defaults changed: "
             f"{changed}; and the preference training flags (`RlhfGroupArguments`, "
             f"docs/rlhf.md):\n"]
    return lines + flag_table(RlhfGroupArguments)


def other_commands():
    """(command, its argument dataclass) for the commands besides pt."""
    from .export import ExportArguments
    from .infer import InferArguments
    from .plot import PlotArguments

    return [("export", ExportArguments), ("infer", InferArguments), ("plot", PlotArguments)]


def accepted(f) -> str:
    """A float flag's accepted values, as docs/cli.md and --help show them."""
    bound = f.metadata["range"].bound()
    kind = "a number (inf too)" if f.metadata.get("allow_inf") else "a finite number"
    return f"{kind} {bound}" if bound != "any number" else kind


def flag_table(dataclass_type) -> List[str]:
    """The markdown table (flag, default, description) of one argument dataclass."""
    lines = ["| flag | default | description |", "| --- | --- | --- |"]
    for f in fields(dataclass_type):
        default = field_default(f)
        shown = "none" if default is None else f"`{default}`"
        text = f.metadata["help"]
        if "choices" in f.metadata:
            text += " One of: " + ", ".join(f"`{c}`" for c in f.metadata["choices"]) + "."
        if "range" in f.metadata:
            text += f" Accepts: {accepted(f)}."
        lines.append(f"| `--{f.name}` | {shown} | {text.replace('|', '/')} |")
    return lines


if __name__ == "__main__":
    print(render(), end="")
