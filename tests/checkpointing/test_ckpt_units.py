"""Unit tests of the checkpoint module's parts that need no model: tracker, commit
protocol, rotation, locating the checkpoint to resume, resume checks, RNG states and safe
loading. One process, no process group (the collective helpers fall back to one rank)."""

import io
import json
import os
import pickle
import random

import numpy as np
import pytest
import torch

from swift_mcore.checkpointing import (TrainState, commit, compat, folders, locate, rng,
                                       safe_load)
from swift_mcore.errors import CheckpointError


def make_sealed(root, iteration, parent_id=None, checkpoint_id=None, payload=b"weights"):
    """A sealed checkpoint folder with one data file, the iteration where save_checkpoint
    writes it (train_state.json, common.pt) and a run.json, as save_checkpoint leaves it."""
    staging = commit.staging_dir(root, iteration, commit.new_token())
    os.makedirs(staging)
    with open(os.path.join(staging, "data.bin"), "wb") as fh:
        fh.write(payload)
    with open(os.path.join(staging, "train_state.json"), "w") as fh:
        json.dump(TrainState(iteration=iteration).to_dict(), fh)
    torch.save({"iteration": iteration}, os.path.join(staging, "common.pt"))
    with open(os.path.join(staging, "run.json"), "w") as fh:
        json.dump({}, fh)
    commit.seal(staging, extra={"id": checkpoint_id or f"id{iteration}",
                                "parent_id": parent_id})
    final = os.path.join(root, folders.iter_dir_name(iteration))
    commit.publish(staging, final)
    return final


# ---- tracker ------------------------------------------------------------------------------
def test_tracker_roundtrip_and_atomic_replace(tmp_path):
    root = str(tmp_path)
    assert folders.read_latest(root)[0] is None
    folders.write_latest(root, 100)
    folders.write_latest(root, 200)
    assert folders.read_latest(root) == (200, None)
    assert os.listdir(root) == [folders.LATEST_FILENAME]  # no temp file left behind
    (tmp_path / folders.LATEST_FILENAME).write_text("garbage")
    value, why = folders.read_latest(root)
    assert value is None and "does not hold an iteration number" in why


def test_iter_dir_names():
    assert folders.iter_dir_name(100) == "iter_0000100"
    assert folders.parse_iter_dir("iter_0000100") == 100
    assert folders.parse_iter_dir(".iter_0000100.tmp-abc") is None
    assert folders.parse_iter_dir("iter_12") is None


# ---- commit protocol ----------------------------------------------------------------------
def test_seal_then_truncation_and_corruption_are_detected(tmp_path):
    folder = make_sealed(str(tmp_path), 5, payload=b"x" * 1000)
    assert commit.check_complete(folder) is None
    commit.verify_checksums(folder)
    data = os.path.join(folder, "data.bin")
    with open(data, "r+b") as fh:            # same size, one byte flipped
        fh.seek(10)
        fh.write(b"y")
    assert commit.check_complete(folder) is None  # the cheap check only stats
    with pytest.raises(CheckpointError, match="corrupted: data.bin does not match"):
        commit.verify_checksums(folder)
    with open(data, "r+b") as fh:
        fh.truncate(500)
    assert "500 bytes, the manifest records 1000" in commit.check_complete(folder)


def test_unsealed_and_foreign_folders_are_not_complete(tmp_path):
    root = str(tmp_path)
    os.makedirs(os.path.join(root, "iter_0000007"))
    assert "no manifest.json" in commit.check_complete(os.path.join(root, "iter_0000007"))
    assert commit.complete_checkpoints(root) == []
    (tmp_path / "iter_0000007" / "manifest.json").write_text('{"format": "other"}')
    assert "not a swift-mcore" in commit.check_complete(os.path.join(root, "iter_0000007"))


def test_publish_replaces_a_folder_of_the_same_iteration(tmp_path):
    root = str(tmp_path)
    make_sealed(root, 3, payload=b"old")
    final = make_sealed(root, 3, payload=b"new")
    assert open(os.path.join(final, "data.bin"), "rb").read() == b"new"
    assert sorted(os.listdir(root)) == ["iter_0000003"]


def test_rotation_keeps_newest_and_the_tracked_one(tmp_path):
    root = str(tmp_path)
    for it in (1, 2, 3, 4, 5):
        make_sealed(root, it)
    os.makedirs(os.path.join(root, "iter_0000006"))       # unsealed: left alone
    removed = commit.rotate(root, keep=2, protect=2, newest=5)
    assert sorted(os.path.basename(p) for p in removed) == ["iter_0000001", "iter_0000003"]
    assert sorted(n for n in os.listdir(root)) == [
        "iter_0000002", "iter_0000004", "iter_0000005", "iter_0000006"]


def test_rotation_leaves_an_abandoned_branch_alone(tmp_path):
    root = str(tmp_path)
    for it in (2, 4, 6, 8):
        make_sealed(root, it)
    # a run resumed from 4 and just saved 5: 6 and 8 belong to the abandoned future
    make_sealed(root, 5)
    commit.rotate(root, keep=1, protect=5, newest=5)
    assert sorted(os.listdir(root)) == ["iter_0000005", "iter_0000006", "iter_0000008"]


def test_stale_staging_folders_are_removed_under_the_run_lock(tmp_path):
    root = str(tmp_path)
    for name in (".iter_0000001.tmp-aa", ".iter_0000002.old-bb", ".iter_0000003.deleting-cc",
                 "iter_0000004"):
        os.makedirs(os.path.join(root, name))
    commit.remove_stale(root, locked=True)
    assert os.listdir(root) == ["iter_0000004"]


def test_without_the_lock_only_a_dead_owners_staging_is_removed(tmp_path):
    """A live process's staging folder is never deleted; a dead one's is (same host)."""
    import subprocess
    import sys

    root = str(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = os.path.basename(commit.staging_dir(root, 2, "ab12")).replace(
        f"-p{os.getpid()}-", f"-p{os.getppid()}-")   # the parent: alive
    gone = os.path.basename(commit.staging_dir(root, 3, "cd34")).replace(
        f"-p{os.getpid()}-", f"-p{dead.pid}-")
    other_host = ".iter_0000004.tmp-ef56-p1-some-other-host"
    for name in (live, gone, other_host, ".iter_0000005.tmp-aa"):
        os.makedirs(os.path.join(root, name))
    assert commit.staging_owner(gone) == (dead.pid, commit._host())
    removed = commit.remove_stale(root)
    assert [os.path.basename(p) for p in removed] == [gone]
    assert sorted(os.listdir(root)) == sorted([live, other_host, ".iter_0000005.tmp-aa"])


# ---- locating the checkpoint to resume ------------------------------------------------------
def test_locate_follows_the_tracker(tmp_path):
    root = str(tmp_path)
    make_sealed(root, 1, checkpoint_id="a")
    make_sealed(root, 2, parent_id="a", checkpoint_id="b")
    folders.write_latest(root, 1)
    make_sealed(root, 9, parent_id="zzz", checkpoint_id="c")  # newer, another lineage
    folders.write_latest(root, 2)
    folder, warnings = locate.resolve("auto", root)
    assert folder.endswith("iter_0000002") and warnings == []


def test_locate_takes_a_sealed_successor_whose_tracker_update_was_cut(tmp_path):
    root = str(tmp_path)
    make_sealed(root, 2, checkpoint_id="b")
    folders.write_latest(root, 2)
    make_sealed(root, 3, parent_id="b", checkpoint_id="c")  # killed before the tracker
    folder, warnings = locate.resolve("auto", root)
    assert folder.endswith("iter_0000003")
    assert "latest_checkpointed_iteration.txt was not updated" in warnings[0]


def test_locate_falls_back_when_the_tracker_points_nowhere(tmp_path):
    root = str(tmp_path)
    make_sealed(root, 2)
    make_sealed(root, 4)
    folders.write_latest(root, 99)
    folder, warnings = locate.resolve("auto", root)
    assert folder.endswith("iter_0000004")
    assert "names iteration 99" in warnings[0] and "falling back" in warnings[0]


def test_locate_errors_when_nothing_complete_is_left(tmp_path):
    root = str(tmp_path)
    folders.write_latest(root, 99)
    before = sorted(os.listdir(root))
    with pytest.raises(CheckpointError, match="no other complete checkpoint"):
        locate.resolve("auto", root)
    assert sorted(os.listdir(root)) == before


def test_locate_empty_root_means_fresh_start(tmp_path):
    assert locate.resolve("auto", str(tmp_path / "none")) == (None, [])
    os.makedirs(tmp_path / "ck" / ".iter_0000001.tmp-x")   # a first save that was killed
    assert locate.resolve("auto", str(tmp_path / "ck")) == (None, [])


def test_locate_explicit_paths(tmp_path):
    root = str(tmp_path)
    good = make_sealed(root, 3)
    assert locate.resolve(good, None) == (good, [])
    assert locate.resolve(root, None)[0] == good  # a root without a tracker: newest complete
    with pytest.raises(CheckpointError, match="does not exist"):
        locate.resolve(str(tmp_path / "missing"), None)
    os.makedirs(os.path.join(root, "iter_0000004"))
    with pytest.raises(CheckpointError, match="not a usable checkpoint: it has no manifest"):
        locate.resolve(os.path.join(root, "iter_0000004"), None)


def reseal(folder, **extra):
    """The manifest rewritten for the folder's files as they are now (and ``extra``)."""
    commit.write_manifest(folder, {**commit.read_manifest(folder)[0], **extra, "files": {
        rel: dict(zip(("size", "crc32"), commit.checksum(os.path.join(folder, rel))))
        for rel in commit.list_files(folder) if rel != commit.MANIFEST_FILENAME}})


def test_locate_refuses_rather_than_replaces_a_folder_whose_files_disagree(tmp_path):
    """The latest-iteration file's checkpoint says another iteration inside than its name: refused
    (the user must decide), not silently replaced by an older complete checkpoint. A common.pt of
    the earliest layout, without an iteration, is not a disagreement."""
    root = str(tmp_path)
    make_sealed(root, 1)
    tracked = make_sealed(root, 2)
    with open(os.path.join(tracked, "train_state.json"), "w") as fh:
        json.dump(TrainState(iteration=7).to_dict(), fh)
    reseal(tracked)
    folders.write_latest(root, 2)
    with pytest.raises(CheckpointError) as info:
        locate.resolve("auto", root, "--resume")
    assert str(info.value) == (
        f"{tracked}/train_state.json says iteration 7 but its folder is iter_0000002 "
        f"(iteration 2): the folder was renamed or holds another save's files; if it is "
        f"iteration 7's save, rename the folder iter_0000007, else pass --resume another "
        f"checkpoint")
    earliest = make_sealed(root, 3)
    torch.save({}, os.path.join(earliest, "common.pt"))
    reseal(earliest)
    assert locate.resolve(earliest, None) == (earliest, [])


@pytest.mark.parametrize("file", ["manifest.json", "run.json"])
def test_the_first_layouts_second_iteration_must_agree_too(tmp_path, file):
    """Checkpoints of the first layout kept the iteration in manifest.json and run.json as
    well: no longer read, but not allowed to disagree unseen."""
    folder = make_sealed(str(tmp_path), 4)
    if file == "run.json":
        with open(os.path.join(folder, file), "w") as fh:
            json.dump({"iteration": 5}, fh)
    reseal(folder, iteration=5 if file == "manifest.json" else None)
    with pytest.raises(CheckpointError) as info:
        locate.resolve(str(tmp_path), None, "--load")
    assert str(info.value) == (
        f"{folder}/{file} says iteration 5, train_state.json iteration 4: the two files come "
        f"from different saves; pass --load another checkpoint")


# ---- resume checks --------------------------------------------------------------------------
def test_resume_differences_name_each_field_with_both_values():
    saved = {"training": {"global_batch_size": 16, "seed": 1, "adam_beta2": 0.95},
             "model": {"seq_length": 256, "hidden_size": 64}}
    now = {"training": {"global_batch_size": 32, "seed": 1, "adam_beta2": 0.99},
           "model": {"seq_length": 128, "hidden_size": 64}}
    lines = compat.resume_differences(saved, now, "abc", "def")
    lines += compat.scheduler_differences({"max_lr": 1e-3, "lr_decay_steps": 300},
                                          {"max_lr": 1e-3, "lr_decay_steps": 600})
    assert "--global_batch_size: checkpoint 16, now 32" in lines
    assert "--seq_length: checkpoint 256, now 128" in lines
    assert "--adam_beta2: checkpoint 0.95, now 0.99" in lines
    assert any(line.startswith("training data (content fingerprint): checkpoint 'abc', now "
                               "'def'") for line in lines)
    assert any(line.startswith("lr_decay_steps") and "300, now 600" in line for line in lines)
    assert not any("seed" in line or "hidden_size" in line for line in lines)
    assert "--override_resume_check" in compat.refusal("/ck", lines)


# ---- RNG ------------------------------------------------------------------------------------
def test_rng_roundtrip_through_json():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(3)
    states = json.loads(json.dumps(rng.capture(cuda=False)))
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    assert set(rng.apply(states, cuda=False)) >= {"python", "numpy", "torch"}
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_rng_choice_by_layout():
    def lay(tp, pp, dp, tps=1, pps=1, dps=2):
        return {"tp_rank": tp, "pp_rank": pp, "dp_rank": dp, "tp_size": tps, "pp_size": pps,
                "dp_size": dps}

    saved = {0: lay(0, 0, 0), 1: lay(0, 0, 1)}
    assert rng.choose(saved, lay(0, 0, 1)) == (1, "")
    assert rng.choose({0: lay(0, 0, 0, dps=1)}, lay(0, 0, 1))[0] == 0  # DP 1 -> 2
    source, note = rng.choose(saved, lay(0, 0, 0, tps=2, dps=1))
    assert source is None and "tensor/pipeline-parallel sizes changed" in note


# ---- safe loading ---------------------------------------------------------------------------
class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_metadata_unpickler_refuses_arbitrary_globals():
    from torch.distributed.checkpoint.metadata import Metadata

    good = pickle.dumps(Metadata(state_dict_metadata={}))
    assert isinstance(safe_load.load_dcp_metadata(io.BytesIO(good)), Metadata)
    with pytest.raises(pickle.UnpicklingError, match="refusing to build"):
        safe_load.load_dcp_metadata(io.BytesIO(pickle.dumps(_Evil())))


# ---- flag validation --------------------------------------------------------------------
def test_resume_and_load_flags_are_checked_before_any_work(tmp_path):
    from swift_mcore.errors import ArgumentError
    from swift_mcore.arguments import RunArguments
    from swift_mcore.run_config import resolve

    def validate(**flags):
        resolve(RunArguments.from_flags(**flags), world_size=1, cuda=False)

    with pytest.raises(ArgumentError, match="--resume .*missing: no such checkpoint folder"):
        validate(resume=str(tmp_path / "missing"))
    with pytest.raises(ArgumentError, match="needs --finetune; to continue a run use --resume"):
        validate(load=str(tmp_path))
    validate(load=str(tmp_path), finetune=True)
    validate(resume="auto")


def test_the_layout_change_line_names_only_what_was_resharded():
    """--no_load_optim (or a checkpoint saved before any step) restores no optimizer state:
    the resume line must not say it was resharded."""
    from swift_mcore.checkpointing.load import _log_layout_change

    saved = {"tp_size": 1, "pp_size": 1, "dp_size": 2}
    lines = []
    _log_layout_change(saved, lines.append, optimizer=True)
    _log_layout_change(saved, lines.append, optimizer=False)
    assert lines == [
        "parallel layout changed since the checkpoint (TP 1 x PP 1 x DP 2 -> TP 1 x PP 1 x "
        "DP 1): weights and optimizer state were resharded; the data position is global and "
        "unchanged",
        "parallel layout changed since the checkpoint (TP 1 x PP 1 x DP 2 -> TP 1 x PP 1 x "
        "DP 1): weights were resharded; the data position is global and unchanged"]
