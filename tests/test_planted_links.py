"""Links planted in a run folder by anyone who can write it (runtime/run_files.py): a
symbolic or hard link named as the run lock, metrics.jsonl, sample_ids.jsonl, the elastic
failure records, trackers.json or loss.png, pointing at a file of the user outside the run.
Every command refuses with one line naming the path and exits 2; the victim file, the link
and the run's records are left exactly as they were. The checkpoint folder as a link into
another run is refused the same way. Outputs the user names (`plot --output`, `export
--output_dir`) never replace a file the command did not write."""

import json
import os
import subprocess
import sys

import pytest

from run_helpers import ROOT, TINY, child_env, run_pt
from swift_mcore.errors import ArgumentError, OutputError
from swift_mcore.runtime import elastic, run_files, run_lock

VICTIM_TEXT = "the user's precious file\n"
RECORDS = [run_lock.LOCK_FILENAME, *run_files.RUN_RECORDS]


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "home" / "precious.txt"
    path.parent.mkdir()
    path.write_text(VICTIM_TEXT)
    return path


def plant(folder, name, victim, kind):
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / name
    if kind == "symlink":
        os.symlink(victim, link)
    else:
        os.link(victim, link)
    return link


def assert_untouched(victim, link, kind):
    assert victim.read_text() == VICTIM_TEXT
    assert os.path.lexists(link)
    if kind == "symlink":
        assert os.readlink(link) == str(victim)
    else:
        assert os.stat(link).st_ino == os.stat(victim).st_ino and victim.stat().st_nlink >= 2


def pt_in_process(out, capsys, monkeypatch):
    """`swift-mcore pt` in this process up to training, which is a stub that trains nothing
    and succeeds: what runs is the command's own parse, resolve, lock and release, which is
    where a planted lock file was deleted or overwritten (with exit code 0)."""
    from swift_mcore import cli

    for name in ("NPROC_PER_NODE", "LOCAL_RANK", "RANK", run_lock.ENV):
        monkeypatch.delenv(name, raising=False)
    trained = []
    monkeypatch.setattr(cli, "_train", lambda prog, config: trained.append(prog) or 0)
    capsys.readouterr()
    code = cli.run_pretrain([*TINY, "--output_dir", str(out)])
    captured = capsys.readouterr()
    return code, captured.err, trained


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
@pytest.mark.parametrize("name", RECORDS)
def test_a_planted_record_refuses_the_run_and_the_victim_is_intact(
        tmp_path, victim, name, kind, capsys, monkeypatch):
    out = tmp_path / "run"
    link = plant(out, name, victim, kind)
    code, err, trained = pt_in_process(out, capsys, monkeypatch)
    assert code == 2 and not trained, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    problem = "is a symbolic link" if kind == "symlink" else "is a hard link (2 names"
    assert err.startswith(f"swift-mcore pt: error: --output_dir {out}: ")
    assert f"{out}/{name} {problem}" in err, err
    assert_untouched(victim, link, kind)
    assert sorted(os.listdir(out)) == [name]  # nothing else written into the folder


def test_a_planted_fifo_as_the_lock_is_refused_without_blocking(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    os.mkfifo(out / run_lock.LOCK_FILENAME)
    code, err, _ = pt_in_process(out, capsys, monkeypatch)
    assert code == 2 and "is not a regular file" in err, err


def test_a_full_run_on_a_folder_with_a_planted_hard_link_exits_2_victim_intact(tmp_path, victim):
    """As the attacker leaves it: a hard link to the victim as metrics.jsonl, then the user
    trains there (a real `swift-mcore pt` process)."""
    out = tmp_path / "run"
    link = plant(out, "metrics.jsonl", victim, "hardlink")
    proc = run_pt(out, "--train_iters", "2", "--no_save", check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"swift-mcore pt: error: --output_dir {out}: {out}/metrics.jsonl is a hard link (2 "
        f"names for one file); swift-mcore writes its run files only as regular files of "
        f"their own and never follows a link planted in a run folder: remove "
        f"{out}/metrics.jsonl, or choose another output folder")
    assert_untouched(victim, link, "hardlink")
    assert not (out / run_lock.LOCK_FILENAME).exists()


# ---- the same refusal where the file is opened (a link planted after the run started) -----
@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_records_opened_later_never_follow_a_link(tmp_path, victim, kind):
    from swift_mcore.training.writers import MetricWriter

    out = tmp_path / "run"
    link = plant(out, "metrics.jsonl", victim, kind)
    with pytest.raises(OutputError, match=f"{out}/metrics.jsonl is a "):
        MetricWriter(str(out), 10, 0, active=True, progress_bar=False)
    ids = plant(out, run_files.SAMPLE_IDS, victim, kind)  # the sample-id audit's file
    with pytest.raises(OutputError, match=f"{out}/{run_files.SAMPLE_IDS} is a "):
        run_files.append_line(str(ids), '{"iteration": 1, "sample_ids": [0]}\n')
    # A dangling link is not created through either (O_CREAT would follow it).
    dangling = out / "dangling.jsonl"
    os.symlink(tmp_path / "home" / "created-by-the-run", dangling)
    with pytest.raises(OutputError, match="is a symbolic link"):
        run_files.append_line(str(dangling), "x\n")
    assert not (tmp_path / "home" / "created-by-the-run").exists()
    assert_untouched(victim, link, kind)


def test_elastic_failure_records_never_follow_a_link(tmp_path, victim, capsys):
    out = tmp_path / "run"
    link = plant(out, elastic.FAILURES, victim, "symlink")
    attempt = elastic.Attempt(1, 3)
    assert elastic.record_failure(str(out), attempt, 0, 4, 5, RuntimeError("boom")) is None
    assert f"{out}/{elastic.FAILURES} is a symbolic link" in capsys.readouterr().err
    assert_untouched(victim, link, "symlink")


def test_the_lock_is_released_by_name_and_only_if_it_is_still_the_lock(tmp_path, victim):
    out = tmp_path / "run"
    lock = run_lock.acquire(str(out), "test")
    lock_path = out / run_lock.LOCK_FILENAME
    assert lock.path == str(lock_path)
    os.replace(lock_path, tmp_path / "moved-lock")  # replaced under the holder by a link
    os.symlink(victim, lock_path)
    run_lock.release(str(out))
    assert_untouched(victim, lock_path, "symlink")


# ---- the checkpoint folder, and --output_dir given through a link -------------------------
def test_a_checkpoint_folder_linked_into_another_run_is_refused(tmp_path, capsys, monkeypatch):
    other = tmp_path / "other_run"
    (other / "checkpoint" / "iter_0000002").mkdir(parents=True)
    (other / "checkpoint" / "latest_checkpointed_iteration.txt").write_text("2")
    out = tmp_path / "run"
    out.mkdir()
    os.symlink(other / "checkpoint", out / "checkpoint")
    code, err, trained = pt_in_process(out, capsys, monkeypatch)
    assert code == 2 and not trained, err
    assert err.strip() == (
        f"swift-mcore pt: error: --output_dir {out}: {out}/checkpoint is a link (to "
        f"{other}/checkpoint); a run keeps its checkpoints in a folder of its own, which its "
        f"lock covers (a link could take them into another run's folder): remove the link, or "
        f"choose another --output_dir")
    assert (other / "checkpoint" / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert sorted(os.listdir(other / "checkpoint")) == ["iter_0000002",
                                                        "latest_checkpointed_iteration.txt"]


def test_an_output_dir_given_through_a_link_locks_the_real_folder(tmp_path):
    real = tmp_path / "real"
    alias = tmp_path / "alias"
    real.mkdir()
    os.symlink(real, alias)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from swift_mcore.runtime import run_lock; "
         "run_lock.acquire(sys.argv[1], 'holder'); print('held', flush=True); "
         "sys.stdin.readline()", str(real)],
        cwd=ROOT, env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ArgumentError, match="is in use by another run"):
            run_lock.acquire(str(alias), "test")
    finally:
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(30)


# ---- the best checkpoint's record and links ------------------------------------------------
def test_best_record_and_links_replace_names_never_planted_targets(tmp_path, victim):
    from swift_mcore.checkpointing import best
    from swift_mcore.checkpointing.state import TrainState

    root = tmp_path / "run" / "checkpoint"
    (root / "iter_0000004").mkdir(parents=True)
    json_link = plant(root, best.RECORD, victim, "symlink")
    hf_link = plant(root, best.HF_LINK, victim, "hardlink")
    state = TrainState(iteration=4)
    state.best_metric, state.best_value, state.best_iteration = "val_loss", 1.5, 4
    state.best_greater_is_better = False
    record = best.write(str(root), state)
    assert record["iteration"] == 4 and json.loads(json_link.read_text())["value"] == 1.5
    assert not json_link.is_symlink()  # the name was replaced, the victim not written
    assert not os.path.lexists(hf_link)  # removed by name (no -hf folder)
    assert os.readlink(root / best.LINK) == "iter_0000004"
    assert victim.read_text() == VICTIM_TEXT and victim.stat().st_nlink == 1


# ---- trackers.json -------------------------------------------------------------------------
def test_trackers_json_is_never_written_through_a_link(tmp_path, victim, monkeypatch):
    from swift_mcore.training import trackers

    out = tmp_path / "run"
    out.mkdir()
    hard = plant(out, run_files.TRACKER_IDS, victim, "hardlink")
    with pytest.raises(OutputError, match="is a hard link"):
        trackers.write_run_ids(str(out), {"wandb": "abc"})
    assert_untouched(victim, hard, "hardlink")
    # Where the trackers start (planted after the run's own check): the ArgumentError every
    # rank raises, the tracker that started closed again.
    closed = []

    class Fake(trackers.Tracker):
        name = "wandb"

        def __init__(self, *args):
            pass

        def close(self, failed=False):
            closed.append(failed)

    monkeypatch.setitem(trackers.KINDS, "wandb", (Fake, "hint"))
    with pytest.raises(ArgumentError, match=r"^--report_to wandb: .*trackers.json is a hard "
                                            r"link"):
        trackers.start(["wandb"], str(out), {}, None, resumed=False)
    assert closed == [True]
    assert_untouched(victim, hard, "hardlink")


@pytest.mark.parametrize("content", ["{not json", '["a list"]', '{"wandb": 7}', "\xff\xfe"])
def test_a_garbage_trackers_json_stops_a_resume_with_one_line(tmp_path, content):
    from swift_mcore.training import trackers

    out = tmp_path / "run"
    out.mkdir()
    (out / "trackers.json").write_text(content, encoding="latin-1")
    with pytest.raises(ArgumentError) as refused:
        trackers.start(["tensorboard", "wandb"], str(out), {}, None, resumed=True)
    message = str(refused.value)
    assert message.startswith(f"--report_to wandb: {out}/trackers.json cannot be read (")
    assert "Restore it, or delete it to start new tracked runs" in message
    assert "\n" not in message
    assert (out / "trackers.json").read_text(encoding="latin-1") == content
    assert trackers.read_run_ids(str(tmp_path / "no_such")) == {}


# ---- outputs the user names: `plot --output`, `export --output_dir` ------------------------
def plot(argv, capsys):
    from swift_mcore.plot import main

    capsys.readouterr()
    code = main([str(a) for a in argv])
    return code, capsys.readouterr()


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"iteration": it, "split": "train", "loss": 5.0 - it / 10, "lr": 1e-3})
        + "\n" for it in range(1, 6)))
    (run / "checkpoint" / "latest_checkpointed_iteration.txt").write_text("5")
    return run


@pytest.mark.parametrize("target", ["metrics.jsonl",
                                    "checkpoint/latest_checkpointed_iteration.txt"])
def test_plot_output_never_replaces_the_run_s_records(run_dir, target, capsys):
    path = run_dir / target
    before = path.read_bytes()
    code, captured = plot([run_dir, "--output", path], capsys)
    assert code == 2 and captured.out == ""
    assert captured.err == (
        f"swift-mcore plot: error: --output {path} exists and is not a PNG image; it is "
        f"written only as a new file or over a PNG image written before, never over another "
        f"file: choose another name\n")
    assert path.read_bytes() == before
    assert not [n for n in os.listdir(path.parent) if ".tmp-" in n]


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_plot_output_through_a_planted_link_is_refused(run_dir, victim, kind, capsys):
    link = plant(run_dir, "picture.png", victim, kind)
    code, captured = plot([run_dir, "--output", link], capsys)
    problem = "is a symbolic link" if kind == "symlink" else "is a hard link"
    assert code == 2 and f"--output {link} {problem}" in captured.err
    assert len(captured.err.strip().splitlines()) == 1
    assert_untouched(victim, link, kind)


def test_plot_replaces_its_own_png_and_refuses_bad_paths_in_one_line(run_dir, tmp_path, capsys):
    png = tmp_path / "curves.png"
    assert plot([run_dir, "--output", png], capsys)[0] == 0
    first = png.read_bytes()
    assert first.startswith(b"\x89PNG")
    assert plot([run_dir, "--output", png], capsys)[0] == 0  # a plot it wrote: replaced
    for bad, says in ((tmp_path, f"--output {tmp_path} is a folder"),
                      (tmp_path / "no" / "x.png",
                       f"--output {tmp_path}/no/x.png: its folder {tmp_path}/no does not exist")):
        code, captured = plot([run_dir, "--output", bad], capsys)
        assert code == 2 and captured.err.startswith(f"swift-mcore plot: error: {says}")
        assert len(captured.err.strip().splitlines()) == 1 and "Traceback" not in captured.err


def test_plot_errors_name_the_file(run_dir, capsys):
    metrics = run_dir / "metrics.jsonl"
    metrics.write_bytes(b"\xff\xfe garbage\n")
    code, captured = plot([run_dir], capsys)
    assert code == 2
    assert captured.err.startswith(f"swift-mcore plot: error: {metrics} cannot be read (not "
                                   f"utf-8 text")
    metrics.write_text('{"iteration": 1, "split": "train", "loss": "high"}\n')
    code, captured = plot([run_dir], capsys)
    assert (code, captured.err) == (2, f"swift-mcore plot: error: {metrics} has no training "
                                       f"loss to plot\n")


@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_export_output_dir_is_never_written_through_a_link(tmp_path, victim, kind, capsys):
    from swift_mcore.export import main

    target = tmp_path / "empty"
    target.mkdir()
    out = tmp_path / "out"
    if kind == "symlink":
        os.symlink(target, out)
    else:
        out.write_text(VICTIM_TEXT)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    capsys.readouterr()
    code = main(["--to_hf", "--model", str(ckpt), "--output_dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert (f"--output_dir {out} is a symbolic link" if kind == "symlink"
            else f"--output_dir {out} is a file") in err
    assert os.listdir(target) == [] and victim.read_text() == VICTIM_TEXT


def test_the_checkpoint_tracker_is_never_written_through_a_planted_temporary_name(
        tmp_path, victim):
    """The tracker used to be written at ``<tracker>.tmp-<pid>``, a name anyone can guess
    and plant a link at: the victim was truncated and given the iteration."""
    from swift_mcore.checkpointing import folders

    root = tmp_path / "run" / "checkpoint"
    root.mkdir(parents=True)
    guessed = plant(root, f"{folders.LATEST_FILENAME}.tmp-{os.getpid()}", victim, "symlink")
    folders.write_latest(str(root), 7)
    assert (root / folders.LATEST_FILENAME).read_text() == "7\n"
    assert_untouched(victim, guessed, "symlink")
