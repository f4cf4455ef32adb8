"""The sample-id audit (--log_sample_ids): the global sample positions each iteration really
fed the model, gathered over data-parallel ranks and appended to output_dir/sample_ids.jsonl
(a run file: never through a planted link, a line whole or not at all)."""

from __future__ import annotations

import os
from typing import List

import torch
import torch.distributed as dist

from ..runtime import run_files


class SampleAudit:
    """``add`` each training micro-batch's ids; ``write`` once per iteration (collective
    over the data-parallel group; the writing rank appends)."""

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, run_files.SAMPLE_IDS)
        self._ids: List[torch.Tensor] = []

    def reset(self) -> None:
        self._ids = []

    def add(self, sample_ids: torch.Tensor) -> None:
        self._ids.append(sample_ids)

    def write(self, iteration: int, active: bool) -> None:
        from megatron.core import parallel_state

        mine = torch.cat(self._ids) if self._ids else torch.zeros(0)
        group = parallel_state.get_data_parallel_group()
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine.tolist(), group=group)
        if active:
            ids = sorted(i for part in gathered for i in part)
            run_files.append_line(self.path,
                                  f'{{"iteration": {iteration}, "sample_ids": {ids}}}\n')
