"""`swift-mcore plot OUTPUT_DIR`: a run's loss curves as OUTPUT_DIR/loss.png (what a run
also writes when it ends; training/plot.py draws it)."""

from __future__ import annotations

import argparse
from typing import List

from .arguments.plot import PlotArguments
from .errors import ArgumentError

DESCRIPTION = """Draw a run's metrics.jsonl: train and validation loss against iterations and
tokens, the learning rate, resumed segments and the best checkpoint marked."""


def parse(argv: List[str]) -> PlotArguments:
    from .arguments.parser import add_flags

    parser = argparse.ArgumentParser(prog="swift-mcore plot", description=DESCRIPTION,
                                     argument_default=argparse.SUPPRESS)
    parser.add_argument("run", nargs="?", metavar="OUTPUT_DIR", help="the run's output_dir")
    add_flags(parser, PlotArguments)
    values = vars(parser.parse_args(argv))
    run = values.pop("run", None)
    if run is not None and values.get("output_dir") not in (None, run):
        raise ArgumentError(f"two output folders given: {run} and --output_dir "
                            f"{values['output_dir']}")
    if run is not None:
        values["output_dir"] = run
    return PlotArguments(**values).validate()


def run(args: PlotArguments) -> str:
    import os

    from .training.plot import write_plot

    try:
        path = write_plot(os.path.expanduser(args.output_dir),
                          args.output and os.path.expanduser(args.output),
                          flag="--output" if args.output else "")
    except ValueError as err:
        raise ArgumentError(str(err)) from None
    print(f"wrote {path}")
    return path


def main(argv: List[str]) -> int:
    from .launch import run_command

    return run_command("plot", argv, parse, run, shutdown=False)
