"""A disk that fills up outside a checkpoint save, on a real (small tmpfs) disk: the metrics
record of a training run, `export --to_hf`'s folder, `plot`'s PNG. Each stops with one line
naming the file and the full disk (exit 2, no traceback) and leaves nothing half-written:
metrics.jsonl holds whole records only, export's staging folder is gone, an existing plot
is as it was. Skipped where a tmpfs cannot be mounted (not root, a container without
CAP_SYS_ADMIN)."""

import errno
import json
import os
import subprocess
import sys

import pytest

from run_helpers import ROOT, child_env, run_pt, tmpfs

PAGE = 4096  # tmpfs allocates whole pages


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs; unmounted after the test."""
    with tmpfs(tmp_path / "disk", "2m") as mount:
        yield mount


def fill(disk, leave_pages: int = 0):
    """Fill ``disk`` up, then free ``leave_pages`` pages again."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while os.write(fd, b"\0" * PAGE) == PAGE:
            pass
    except OSError as err:
        assert err.errno == errno.ENOSPC
    finally:
        os.close(fd)
    size = filler.stat().st_size // PAGE * PAGE
    os.truncate(filler, size - leave_pages * PAGE)


def one_line_error(proc, command):
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"swift-mcore {command}: error: writing "), line
    return line


def test_metrics_jsonl_on_a_full_disk_stops_with_one_line_and_whole_records(small_disk,
                                                                           tmp_path):
    out = small_disk / "run"
    out.mkdir()
    fill(small_disk, leave_pages=2)  # the lock file's page and one of metrics.jsonl
    proc = run_pt(out, "--train_iters", "60", "--no_save", "--data_cache_path",
                  tmp_path / "cache", check=False, timeout=400)
    line = one_line_error(proc, "pt")
    assert line == (f"swift-mcore pt: error: writing {out}/metrics.jsonl failed: out of disk "
                    f"space (No space left on device); nothing half-written was left in it. "
                    f"Free some space, then continue with --resume")
    records = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r["iteration"] for r in records if r["split"] == "train"]
    assert records[0]["split"] == "start" and train == list(range(1, len(train) + 1))
    assert 5 < len(train) < 60
    assert (out / "metrics.jsonl").read_text().endswith("\n")
    assert sorted(os.listdir(out)) == ["metrics.jsonl"]  # the lock released, nothing else


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "run"
    run_pt(out, "--train_iters", "1")
    return out / "checkpoint" / "iter_0000001"


def export(checkpoint, out, *flags):
    cmd = [sys.executable, "-m", "swift_mcore", "export", "--model", str(checkpoint),
           "--output_dir", str(out), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=child_env(),
                          cwd=ROOT)


def test_export_to_hf_on_a_full_disk_removes_its_staging_folder(small_disk, checkpoint):
    out = small_disk / "hf"  # the tiny model's float32 weights need more than 2 MiB
    proc = export(checkpoint, out, "--to_hf")
    line = one_line_error(proc, "export")
    assert line == (f"swift-mcore export: error: writing {out} failed: out of disk space (No "
                    f"space left on device); the partial folder was removed and {out} is as "
                    f"it was. Free some space, then run it again")
    assert os.listdir(small_disk) == []  # no staging folder filling the disk
    assert os.statvfs(small_disk).f_bfree == os.statvfs(small_disk).f_blocks


def test_plot_on_a_full_disk_leaves_the_old_plot_and_no_temporary_file(small_disk, tmp_path):
    from swift_mcore.plot import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"iteration": it, "split": "train", "loss": 5.0 - it / 10, "lr": 1e-3})
        + "\n" for it in range(1, 6)))
    old = small_disk / "loss.png"
    assert main([str(run), "--output", str(old)]) == 0
    before = old.read_bytes()
    fill(small_disk)
    proc = subprocess.run([sys.executable, "-m", "swift_mcore", "plot", str(run), "--output",
                           str(old)], capture_output=True, text=True, timeout=200,
                          env=child_env(), cwd=ROOT)
    line = one_line_error(proc, "plot")
    assert line == (f"swift-mcore plot: error: writing {old} failed: out of disk space (No "
                    f"space left on device); it was left as it was. Free some space, then "
                    f"run it again")
    assert old.read_bytes() == before
    assert sorted(os.listdir(small_disk)) == ["filler", "loss.png"]
