"""One run per --output_dir (swift_mcore/runtime/run_lock.py): a second run on a live
folder exits 2 at start with one line naming the folder and the holder (pid, host, start
time), changing nothing; the first finishes with intact, resumable checkpoints. A SIGKILLed
run (its forked children still alive) does not block --resume. A two-rank run holds one
lock for all its ranks."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import ckpt_harness as H
from run_helpers import ROOT, TINY, losses, run_pt
from swift_mcore.checkpointing import commit, folders
from swift_mcore.errors import ArgumentError
from swift_mcore.runtime import run_lock


def holder_pid(out):
    try:
        with open(os.path.join(out, run_lock.LOCK_FILENAME), encoding="utf-8") as fh:
            return json.load(fh).get("pid")
    except (OSError, ValueError):
        return None


def check_refusal(proc, out, pid):
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"swift-mcore pt: error: --output_dir {out} is in use by another "
                           f"run: pid {pid} on host {socket.gethostname()} (swift-mcore pt, "
                           f"started 20"), line
    assert f"{out}/{run_lock.LOCK_FILENAME}" in line


def refused_run(out, *flags, capsys, monkeypatch):
    """`swift-mcore pt` on a folder another run holds, run in this process (cli.run_pretrain:
    the command's own parse, resolve and lock, up to the refusal), without the seconds of a
    process start-up per refusal: what is checked is the exit code, the line and that no
    file changed, not the process."""
    from swift_mcore import cli

    for name in ("NPROC_PER_NODE", "LOCAL_RANK", "RANK", run_lock.ENV):
        monkeypatch.delenv(name, raising=False)  # a plain one-process command line

    def started_training(prog, config):  # a run that got past the lock must not train here
        raise AssertionError(f"{prog} was not refused: it started training in the test")

    monkeypatch.setattr(cli, "_train", started_training)
    capsys.readouterr()
    argv = [*TINY, "--output_dir", str(out), *map(str, flags)]
    code = cli.run_pretrain(argv)
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, captured.out, captured.err)


# ---- the lock itself, between processes ----------------------------------------------------
HOLDER = textwrap.dedent("""
    import json, os, subprocess, sys, time
    from swift_mcore.runtime import run_lock
    lock = run_lock.acquire(sys.argv[1], "holder")
    if sys.argv[2] == "fork":  # a forked child (a data loader worker, say) outlives the holder
        ready, done = os.pipe()
        child = os.fork()
        if child == 0:         # the at-fork hook has run by now: say so, then live on
            os.write(done, b"x")
            time.sleep(120)
            os._exit(0)
        os.read(ready, 1)
    else:                      # a child that did inherit the open lock file, for argv[2] s
        child = subprocess.Popen([sys.executable, "-c", "import sys, time; "
                                  "time.sleep(float(sys.argv[1]))", sys.argv[2]],
                                 pass_fds=[lock.fd]).pid
    print(json.dumps({"pid": os.getpid(), "child": child}), flush=True)
    sys.stdin.readline()
    os._exit(0)                # ends without releasing, like a crash
""")


def start_holder(out, child):
    """A process that takes the lock on ``out`` and starts a child ("fork", or a number of
    seconds for a child that keeps the lock file open); it ends at end_holder."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, out, child], cwd=ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    return holder, json.loads(holder.stdout.readline())


def end_holder(holder):
    holder.stdin.write("end\n")
    holder.stdin.flush()
    holder.wait(30)


HANDED = textwrap.dedent("""
    import os, sys
    from swift_mcore.runtime import run_lock
    lock = run_lock.acquire(sys.argv[1], "rank 0")
    print("handed over" if lock.fd is None and run_lock.holds(sys.argv[1]) else "other")
    run_lock.release(sys.argv[1])
    os.environ[run_lock.ENV] = "wrongtoken " + os.environ[run_lock.ENV].split(" ", 1)[1]
    try:
        run_lock.acquire(sys.argv[1], "rank 0")
    except Exception as err:
        print("refused:", err)
""")


def test_lock_between_processes(tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    holder, pids = start_holder(out, "fork")
    try:
        with pytest.raises(ArgumentError) as refused:
            run_lock.acquire(out, "test")
        assert f"is in use by another run: pid {pids['pid']} on host " in str(refused.value)
        assert "Wait for that run to end" in str(refused.value)
        assert not run_lock.holds(out)
        end_holder(holder)
        assert run_lock.pid_alive(pids["child"])   # its forked child lives on ...
        # ... but does not hold the lock: with no grace for an ended holder's children, a
        # lock still held would be refused here rather than waited for
        monkeypatch.setattr(run_lock, "ENDED_HOLDER_GRACE_S", 0.0)
        lock = run_lock.acquire(out, "test")
        assert run_lock.acquire(out, "again") is lock and run_lock.holds(out)  # re-entrant
        assert json.load(open(lock.path))["pid"] == os.getpid()

        # A launcher hands its lock to the ranks it starts; a wrong token is refused.
        env = {**os.environ, **run_lock.child_env(lock)}
        text = subprocess.run([sys.executable, "-c", HANDED, out], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120).stdout
        assert text.startswith("handed over\nrefused: --output_dir "), text
        assert f"pid {os.getpid()}" in text
    finally:
        os.kill(pids["child"], signal.SIGKILL)
        holder.kill()
        run_lock.release(out)
    assert not os.path.exists(os.path.join(out, run_lock.LOCK_FILENAME))


def test_a_lock_left_to_the_children_of_an_ended_holder(tmp_path, monkeypatch):
    """Such a child may be about to close its copy (a forked one does when first scheduled):
    the lock is waited for, ENDED_HOLDER_GRACE_S; one kept beyond that is refused, naming
    the ended holder and what to do."""
    out = str(tmp_path / "run")
    holder, pids = start_holder(out, "120")   # the child keeps the lock file open
    waits = []
    real_sleep = time.sleep

    def waiting(seconds):  # acquire's poll while the lock is held: end the child on the first
        if not waits:
            os.kill(pids["child"], signal.SIGKILL)
        waits.append(seconds)
        real_sleep(seconds)

    # The grace only bounds a hang here: the child ends at acquire's first wait.
    monkeypatch.setattr(run_lock, "ENDED_HOLDER_GRACE_S", 120.0)
    try:
        end_holder(holder)
        with monkeypatch.context() as patched:
            patched.setattr(run_lock.time, "sleep", waiting)
            lock = run_lock.acquire(out, "test")
        assert waits, "the lock was taken without waiting for the holder's child"
        assert json.load(open(lock.path))["pid"] == os.getpid()
    finally:
        if run_lock.pid_alive(pids["child"]):
            os.kill(pids["child"], signal.SIGKILL)
        run_lock.release(out)

    holder, pids = start_holder(out, "120")
    monkeypatch.setattr(run_lock, "ENDED_HOLDER_GRACE_S", 0.3)
    try:
        end_holder(holder)
        started = time.monotonic()
        with pytest.raises(ArgumentError) as refused:
            run_lock.acquire(out, "test")
        assert time.monotonic() - started >= 0.3
        lock_path = os.path.realpath(os.path.join(out, run_lock.LOCK_FILENAME))
        assert str(refused.value) == (
            f"--output_dir {os.path.abspath(out)} is in use by another run: pid {pids['pid']} "
            f"on host {socket.gethostname()} (holder, started "
            f"{json.load(open(lock_path))['started']}) has ended, but a process it started "
            f"still holds its lock file {lock_path} (`fuser -v {lock_path}` names it). Stop "
            f"that process, or choose another --output_dir.")
        os.kill(pids["child"], signal.SIGKILL)
        # (the kernel closes the child's file as it ends: the grace only bounds a hang)
        monkeypatch.setattr(run_lock, "ENDED_HOLDER_GRACE_S", 120.0)
        run_lock.acquire(out, "test")   # once the child is gone, the lock is free
        assert run_lock.holds(out)
    finally:
        if run_lock.pid_alive(pids["child"]):
            os.kill(pids["child"], signal.SIGKILL)
        run_lock.release(out)


# ---- real runs -------------------------------------------------------------------------------
@pytest.mark.slow
def test_second_run_on_a_live_output_dir_exits_2_and_the_first_is_intact(
        tmp_path, straight_cli, capsys, monkeypatch):
    out = str(tmp_path / "run")
    first = H.start_cli(out, *H.CLI_FLAGS, "--exit_interval", "4")
    try:
        H.wait_until(lambda: holder_pid(out) == first.pid and H.cli_iterations(out) >= 1,
                     first)
        os.killpg(first.pid, signal.SIGSTOP)  # hold the first run still, mid-training
        before = H.tree_snapshot(out)
        second = refused_run(out, *H.CLI_FLAGS, capsys=capsys, monkeypatch=monkeypatch)
        third = refused_run(out, *H.CLI_FLAGS, "--resume", capsys=capsys,
                            monkeypatch=monkeypatch)
        assert H.tree_snapshot(out) == before, "a refused run changed files"
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    check_refusal(second, out, first.pid)
    check_refusal(third, out, first.pid)
    assert first.wait(240) == 0, open(out + ".stderr").read()[-3000:]

    root = os.path.join(out, "checkpoint")
    assert folders.read_latest(root)[0] == 4
    assert [it for it, _ in commit.complete_checkpoints(root)] == [2, 4]
    for _, folder in commit.complete_checkpoints(root):
        commit.verify_checksums(folder)
    assert not H.staging_folders(out)
    assert not os.path.exists(os.path.join(out, run_lock.LOCK_FILENAME))  # released

    run_pt(out, *H.CLI_FLAGS, "--resume")  # and it continues exactly
    assert losses(out) == losses(straight_cli)
    assert H.committed_history(out) == H.committed_history(str(straight_cli))


@pytest.mark.slow
def test_sigkilled_run_does_not_block_resume(tmp_path, straight_cli):
    """Killed with a data loader worker (forked) still alive: the lock is free at once."""
    out = str(tmp_path / "run")
    run = H.start_cli(out, *H.CLI_FLAGS, "--num_workers", "1")
    try:
        H.wait_until(lambda: H.cli_iterations(out) >= 3, run)
        os.kill(run.pid, signal.SIGKILL)  # the trainer only, not its worker
        run.wait(30)
        assert holder_pid(out) == run.pid  # the lock file is left behind, naming it
        resumed = run_pt(out, *H.CLI_FLAGS, "--num_workers", "1", "--resume", check=False)
    finally:
        try:
            os.killpg(run.pid, signal.SIGKILL)  # the orphaned worker
        except ProcessLookupError:
            pass
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert losses(out) == losses(straight_cli)
    assert H.committed_history(out) == H.committed_history(str(straight_cli))


@pytest.mark.slow
def test_two_rank_run_holds_one_lock_for_its_ranks(tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "run")
    run = H.start_cli(out, "--train_iters", "3", "--save_steps", "1", nproc=2)
    try:
        H.wait_until(lambda: H.cli_iterations(out) >= 1, run, timeout=240)
        assert holder_pid(out) == run.pid  # the launcher holds it for both ranks
        os.killpg(run.pid, signal.SIGSTOP)
        second = refused_run(out, "--train_iters", "3", capsys=capsys,
                             monkeypatch=monkeypatch)
    finally:
        os.killpg(run.pid, signal.SIGCONT)
    check_refusal(second, out, run.pid)
    assert run.wait(240) == 0, open(out + ".stderr").read()[-3000:]
    root = os.path.join(out, "checkpoint")
    assert [it for it, _ in commit.complete_checkpoints(root)] == [1, 2, 3]
    assert not os.path.exists(os.path.join(out, run_lock.LOCK_FILENAME))
