"""Flags of `swift-mcore plot`: which run, where the picture goes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from ..errors import ArgumentError
from .fields import check_flags, flag


@dataclass
class PlotArguments:
    output_dir: Optional[str] = flag(
        None, "The run's output_dir (the folder holding metrics.jsonl); also accepted as the "
        "first argument: `swift-mcore plot OUTPUT_DIR`. Required.")
    output: Optional[str] = flag(
        None, "Where to write the PNG; default OUTPUT_DIR/loss.png. A new file, or a PNG "
        "image (a plot written before): any other file there is refused, never replaced.")

    def validate(self) -> "PlotArguments":
        check_flags(self)
        if not self.output_dir:
            raise ArgumentError("give the run's output folder: swift-mcore plot OUTPUT_DIR")
        metrics = os.path.join(os.path.expanduser(self.output_dir), "metrics.jsonl")
        if not os.path.isfile(metrics):
            raise ArgumentError(f"{self.output_dir} holds no metrics.jsonl (give the "
                                f"--output_dir of a pt or sft run)")
        return self
