"""Checkpoint folders built as an attacker would (issue 35): a FIFO or a device in place of
any file a load reads, a manifest or a .metadata naming files outside the folder, a manifest
whose table is malformed, JSON nested 100,000 levels deep. Each is refused in one line naming
the file, exit code 2, and nothing blocks: every call that could block runs under a
deadline (tests/bounded.py), so a regression fails the test instead of hanging pytest."""

import json
import os
import shutil

import pytest

from bounded import cli, deadline
from run_helpers import run_pt
from swift_mcore.checkpointing import commit, locate, safe_load
from swift_mcore.errors import CheckpointError

FIFO = "is a FIFO (named pipe), not a regular file"
FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "fixtures", "megatron_lm")
# The commands run in this process (cli.main): their one-rank group is this module's.
pytestmark = pytest.mark.usefixtures("gloo_group")


def cli_error(command, *argv):
    """The one line the CLI printed for a refused command: exit code 2, no traceback."""
    code, lines = cli(command, *argv)
    assert code == 2, (code, lines)
    assert len(lines) == 1, lines  # no traceback either
    assert lines[0].startswith(f"swift-mcore {command}: error: "), lines[0]
    return lines[0]


def make_fifo(path):
    os.remove(path)
    os.mkfifo(path)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A pt run saved at iteration 2."""
    out = tmp_path_factory.mktemp("hostile_ckpt") / "run"
    run_pt(out, "--train_iters", "2", "--save_steps", "2")
    return str(out)


@pytest.fixture
def run(made, tmp_path):
    out = str(tmp_path / "run")
    shutil.copytree(made, out)
    return out


def folder_of(out):
    return os.path.join(out, "checkpoint", "iter_0000002")


def first_distcp(folder):
    return sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))[0]


# ---- a FIFO or a device in place of each file a load reads ---------------------------------

@pytest.mark.parametrize("name", ["manifest.json", "train_state.json", "run.json",
                                  "args.json", "common.pt", ".metadata", "metadata.json",
                                  "distcp", "rng/rank_00000.json"])
def test_a_fifo_in_a_checkpoint_is_refused_naming_it(run, tmp_path, name):
    folder = folder_of(run)
    name = first_distcp(folder) if name == "distcp" else name
    make_fifo(os.path.join(folder, name))
    line = cli_error("export", "--to_hf", "--model", folder, "--output_dir", tmp_path / "hf")
    assert f"{folder} is not a usable checkpoint: " in line, line
    assert f"{name}: is a FIFO (named pipe), not a regular file" in line \
        or f"{name} {FIFO}" in line, line
    assert not (tmp_path / "hf").exists()


def test_a_device_linked_as_common_pt_is_refused(run, tmp_path):
    folder = folder_of(run)
    os.remove(os.path.join(folder, "common.pt"))
    os.symlink("/dev/zero", os.path.join(folder, "common.pt"))
    line = cli_error("export", "--to_hf", "--model", folder, "--output_dir", tmp_path / "hf")
    assert line.endswith(f"{folder} is not a usable checkpoint: common.pt is a character "
                         f"device, not a regular file."), line


def test_a_fifo_as_the_tracker_falls_back_with_a_warning_naming_it(run):
    """The tracker is unreadable like a tracker of garbage: the newest complete checkpoint
    is used and the warning names the file."""
    root = os.path.join(run, "checkpoint")
    tracker = os.path.join(root, "latest_checkpointed_iteration.txt")
    make_fifo(tracker)
    with deadline(90, "locate.resolve"):
        folder, warnings = locate.resolve("auto", root)
    assert folder == folder_of(run)
    assert (f"{tracker}: {FIFO}; swift-mcore reads input only from regular files; falling "
            f"back to the newest complete checkpoint") in str(warnings)


def test_every_reader_refuses_a_fifo_without_blocking(run):
    """Each reader on its own (not only the folder check that runs first), so a file
    swapped for a FIFO after the check is refused too."""
    folder = folder_of(run)
    for name in ("manifest.json", "train_state.json", ".metadata", "common.pt",
                 first_distcp(folder)):
        make_fifo(os.path.join(folder, name))
    from swift_mcore.checkpointing import files, io

    lines = []
    with deadline(90, "the checkpoint readers"):
        lines.append(f"manifest | {commit.read_manifest(folder)[1]}")
        for reader in (lambda: files.read_json(folder, "train_state.json"),
                       lambda: safe_load.read_dcp_metadata(folder),
                       lambda: io.read_common(folder),
                       lambda: commit.checksum(folder + "/" + first_distcp(folder))):
            try:
                reader()
            except Exception as err:
                lines.append(f"{type(err).__name__} | {err}")
    assert lines[0] == f"manifest | its manifest.json: {FIFO}; swift-mcore reads input only " \
                       f"from regular files"
    assert lines[1].startswith(f"CheckpointError | checkpoint {folder}: train_state.json is "
                               f"unreadable ({FIFO}"), lines[1]
    assert lines[2].startswith(f"CheckpointError | checkpoint {folder}: .metadata: {FIFO}")
    assert lines[3].startswith(f"CheckpointError | checkpoint {folder}: common.pt: {FIFO}")
    assert lines[4].startswith(f"ArgumentError | {folder}/{first_distcp(folder)}: {FIFO}")


def test_the_dcp_reader_refuses_a_fifo_named_like_a_distcp_file(run):
    """torch DCP's own reads (the tensors in .distcp files) go through safe_load's file
    system, which opens regular files only."""
    folder = folder_of(run)
    name = first_distcp(folder)
    make_fifo(os.path.join(folder, name))
    fs = safe_load._regular_file_system(folder)
    with deadline(90, "the DCP reader"), pytest.raises(CheckpointError) as caught:
        with fs.create_stream(folder + "/" + name, "rb"):
            pass
    assert str(caught.value) == (f"checkpoint {folder}: {name}: {FIFO}; "
                                 f"swift-mcore reads input only from regular files")


def test_trackers_json_and_best_json_fifos_never_block(tmp_path):
    """trackers.json (read on resume to continue the tracked runs) is refused naming it;
    best.json (read for the plot's star) counts as absent."""
    os.makedirs(tmp_path / "checkpoint")
    os.mkfifo(tmp_path / "trackers.json")
    os.mkfifo(tmp_path / "checkpoint" / "best.json")
    from swift_mcore.checkpointing import best
    from swift_mcore.training import trackers

    out = []
    with deadline(90, "best.read and trackers.read_run_ids"):
        out.append(str(best.read(str(tmp_path / "checkpoint"))))
        try:
            trackers.read_run_ids(str(tmp_path))
        except Exception as err:
            out.append(f"{type(err).__name__} | {err}")
    assert out == [
        "None", f"ArgumentError | --report_to wandb,swanlab: {tmp_path / 'trackers.json'} "
                f"cannot be read ({FIFO}; swift-mcore reads input only from regular files); it "
                f"holds the tracked runs this resumed run continues. Restore it, or delete it "
                f"to start new tracked runs"]


# ---- a Megatron-LM checkpoint (tests/fixtures/megatron_lm) ---------------------------------

@pytest.mark.parametrize("name", ["common.pt", ".metadata", "__0_1.distcp", "metadata.json"])
def test_a_fifo_in_a_megatron_lm_checkpoint_is_refused(tmp_path, name):
    root = tmp_path / "mlm"
    shutil.copytree(FIXTURE, root, ignore=shutil.ignore_patterns("reference", "README.md"))
    folder = root / "iter_0000010"
    make_fifo(folder / name)
    line = cli_error("export", "--to_hf", "--model", folder, "--output_dir", tmp_path / "hf")
    assert line.endswith(f"{folder} is not a usable checkpoint: it is a Megatron-LM "
                         f"checkpoint whose {name} {FIFO}."), line


def test_megatron_lm_metadata_naming_a_file_outside_the_folder_is_refused(tmp_path):
    folder = tmp_path / "iter_0000010"
    shutil.copytree(os.path.join(FIXTURE, "iter_0000010"), folder)
    metadata = safe_load.read_dcp_metadata(str(folder))
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../../../../etc/passwd"
    with pytest.raises(CheckpointError) as caught:
        safe_load.check_storage_paths(metadata, str(folder))
    assert str(caught.value) == (f"checkpoint {folder}: .metadata: names "
                                 f"'../../../../etc/passwd', a path outside its folder "
                                 f"{folder}; only files inside the folder are read")


# ---- the manifest: names inside the folder, a well-formed table, bounded JSON --------------

def rewrite_manifest(folder, change):
    path = os.path.join(folder, "manifest.json")
    with open(path) as fh:
        manifest = json.load(fh)
    change(manifest)
    with open(path, "w") as fh:
        json.dump(manifest, fh)


@pytest.mark.parametrize("change, message", [
    (lambda m: m["files"].update({"../../../../etc/passwd": {"size": 1, "crc32": 0}}),
     "its manifest.json: names '../../../../etc/passwd', a path outside its folder"),
    (lambda m: m["files"].update({"/etc/passwd": {"size": 1, "crc32": 0}}),
     "its manifest.json: names '/etc/passwd', a path outside its folder"),
    (lambda m: m["files"].update({"common.pt": {"size": 1, "crc32": "00ff"}}),
     "its manifest.json records 'common.pt' without a size and crc32"),
    (lambda m: m["files"].update({"common.pt": [1, 2]}),
     "its manifest.json records 'common.pt' without a size and crc32"),
])
def test_a_manifest_naming_outside_files_or_malformed_is_refused(run, change, message):
    folder = folder_of(run)
    rewrite_manifest(folder, change)
    problem = locate.check_usable(folder)
    assert problem is not None and problem.startswith(message), problem
    with pytest.raises(CheckpointError, match="is not a usable checkpoint: " + message[:20]):
        locate.resolve(folder, "unused", "--resume")


def test_a_deeply_nested_json_file_is_one_line(run):
    folder = folder_of(run)
    with open(os.path.join(folder, "manifest.json"), "w") as fh:
        fh.write("[" * 100_000 + "]" * 100_000)
    assert commit.read_manifest(folder)[1] == ("its manifest.json: JSON nested 100000 levels "
                                               "deep; at most 512 are read")
    with open(os.path.join(folder, "run.json"), "w") as fh:
        fh.write('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    from swift_mcore.checkpointing import files
    with pytest.raises(CheckpointError, match=r"run.json is unreadable \(JSON nested 100001 "
                                              r"levels deep; at most 512 are read\)"):
        files.read_json(folder, "run.json")
