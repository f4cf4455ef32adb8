"""A full disk (swift_mcore/checkpointing/space.py): the save fails with one line naming the
folder and the bytes needed, exit 2; its staging folder is removed, the previous checkpoint
is untouched and still the tracker's; once there is room, --resume continues exactly (the
same losses and samples as the uninterrupted run).

The disk fills up during the DCP write through the test hook
SWIFT_MCORE_TEST_FAIL_SAVE_AFTER_BYTES (a short write, then ENOSPC, as write(2) does). Where
this machine lets the test mount a small tmpfs, a real full disk is tried too."""

import os
import re
import subprocess

import pytest

import ckpt_harness as H
from run_helpers import losses, run_pt, tmpfs
from swift_mcore.checkpointing import commit, folders, space


def data_bytes(folder):
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)
               if n.endswith(".distcp"))


def check_failed_save(proc, out, phrase):
    """Exit 2, one line naming the folder and the bytes needed; nothing half-written."""
    root = os.path.join(out, "checkpoint")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("swift-mcore pt: error: "), line
    assert phrase in line and root in line, line
    need = int(re.search(r"needs about ([\d,]+) bytes", line).group(1).replace(",", ""))
    assert need > 7 << 20, line
    assert "latest_checkpointed_iteration.txt still names iteration 2" in line, line
    assert not H.staging_folders(out), os.listdir(root)
    assert folders.read_latest(root)[0] == 2
    assert sorted(os.listdir(root)) == ["iter_0000002", folders.LATEST_FILENAME]
    commit.verify_checksums(os.path.join(root, "iter_0000002"))


def check_exact_resume(out, straight):
    run_pt(out, *H.CLI_FLAGS, "--resume")
    assert losses(out) == losses(straight)
    assert H.committed_history(out) == H.committed_history(str(straight))


@pytest.mark.slow
def test_disk_fills_up_during_the_write_then_exact_resume(tmp_path, straight_cli):
    out = str(tmp_path / "run")
    one = data_bytes(os.path.join(straight_cli, "checkpoint", "iter_0000002"))
    # Room for the first checkpoint (iteration 2) and half of the second (iteration 4).
    proc = run_pt(out, *H.CLI_FLAGS, check=False,
                  env={space.TEST_FAIL_AFTER_BYTES: str(one * 3 // 2)})
    check_failed_save(proc, out, f"saving checkpoint iteration 4 failed: out of disk space "
                                 f"in {out}/checkpoint")
    check_exact_resume(out, straight_cli)


@pytest.fixture
def small_tmpfs(tmp_path):
    # one checkpoint of the test model (7.3 MiB), not two
    with tmpfs(tmp_path / "disk", str(12 << 20)) as mount:
        yield mount


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SWIFT_MCORE_TMPFS_TEST") != "1",
                    reason="a real full disk on a mounted tmpfs (root): SWIFT_MCORE_TMPFS_TEST=1; "
                           "the suite's full-disk test is the ENOSPC writer above")
def test_real_full_disk_is_refused_before_writing_then_exact_resume(tmp_path, small_tmpfs,
                                                                     straight_cli):
    out = str(small_tmpfs / "run")
    cache = ["--data_cache_path", str(tmp_path / "data_cache")]  # off the small disk
    proc = run_pt(out, *H.CLI_FLAGS, *cache, check=False)
    check_failed_save(proc, out, f"not enough disk space to save checkpoint iteration 4 in "
                                 f"{out}/checkpoint")
    # Still full: the resumed run stops at the same save, as clearly, before writing.
    again = run_pt(out, *H.CLI_FLAGS, *cache, "--resume", check=False)
    check_failed_save(again, out, "not enough disk space to save checkpoint iteration 4")
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_tmpfs)], check=True)
    run_pt(out, *H.CLI_FLAGS, *cache, "--resume")
    assert losses(out) == losses(straight_cli)
    assert H.committed_history(out) == H.committed_history(str(straight_cli))
