"""A checkpoint's facts stored twice agree, or it is refused: the iteration in its folder's
name, train_state.json and common.pt (and in manifest.json and run.json, where checkpoints
of the first layout kept it too), and common.pt's sample counters with train_state.json's
(a Megatron-LM checkpoint: common.pt's iteration with its folder's name).

``locate.resolve`` checks the checkpoint every command picks (pt/sft --resume and --load, export,
infer), before anything reads it for use. A folder renamed, or holding files of another save, would
otherwise resume at the wrong step or data position, or be rotated and tracked under the wrong
number. The latest-iteration file names a folder by its iteration, so it agrees with the folder's
name by construction; the manifest's file table is checked against the files on every load
(commit.verify_checksums)."""

from __future__ import annotations

import os
from typing import Optional

from ..errors import CheckpointError
from . import commit, files, megatron_lm
from .folders import iter_dir_name, parse_iter_dir

# TrainState counters that common.pt's args repeat for Megatron-LM's loader
# (megatron_lm.args_namespace), which resumes at them.
SAMPLE_COUNTERS = ("consumed_train_samples", "consumed_valid_samples", "skipped_train_samples")


def check(folder: str, flag: str) -> None:
    """Raise a one-line CheckpointError when ``folder``'s facts disagree; ``flag`` (the
    option that named the checkpoint) goes into the advice."""
    problem = disagreement(folder, flag)
    if problem:
        raise CheckpointError(problem)


def disagreement(folder: str, flag: str) -> Optional[str]:
    """None, or the line naming the file, the two values and what to do."""
    from . import io

    name = os.path.basename(os.path.realpath(folder))  # a link's target names the save
    named = parse_iter_dir(name)
    other = f"pass {flag} another checkpoint"
    if megatron_lm.is_megatron_lm(folder):
        # Only common.pt's own iteration: Megatron-LM's args.iteration and curr_iteration
        # are not the checkpoint's (0 and 9 in tests/fixtures/megatron_lm's iteration 10).
        saved = megatron_lm.read(folder)["iteration"]
        if named is not None and saved != named:
            return _misnamed(folder, "common.pt", saved, name, named, other)
        return None
    state = files.read_train_state(folder)
    if named is not None and state.iteration != named:
        return _misnamed(folder, files.TRAIN_STATE, state.iteration, name, named, other)
    common = io.read_common(folder)
    mixed = f"the two files come from different saves; {other}"
    manifest, _ = commit.read_manifest(folder)  # check_usable found it valid
    # common.pt's is Megatron-LM's copy; the first layout kept one in the manifest and in
    # run.json (not read since, so they must not disagree unseen either)
    for file, saved in (("common.pt", common.get("iteration")),
                        (commit.MANIFEST_FILENAME, (manifest or {}).get("iteration")),
                        (files.RUN, files.read_json(folder, files.RUN).get("iteration"))):
        if saved is not None and saved != state.iteration:
            return (f"{os.path.join(folder, file)} says iteration {saved}, "
                    f"{files.TRAIN_STATE} iteration {state.iteration}: {mixed}")
    args = common.get("args")  # a Namespace since common.pt took Megatron-LM's layout
    for counter in SAMPLE_COUNTERS:
        value = getattr(args, counter, None)
        if value is not None and value != getattr(state, counter):
            return (f"{os.path.join(folder, 'common.pt')} says {counter} {value}, "
                    f"{files.TRAIN_STATE} {getattr(state, counter)}: {mixed}")
    return None


def _misnamed(folder: str, file: str, saved: int, name: str, named: int, other: str) -> str:
    return (f"{os.path.join(folder, file)} says iteration {saved} but its folder is {name} "
            f"(iteration {named}): the folder was renamed or holds another save's files; if "
            f"it is iteration {saved}'s save, rename the folder {iter_dir_name(saved)}, else "
            f"{other}")
