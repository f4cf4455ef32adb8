"""swift-mcore's torchrun launcher on one machine (NPROC_PER_NODE...): without MASTER_PORT
torchrun's standalone rendezvous on a free port, so two runs started at once both run;
MASTER_PORT checked before torchrun starts."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

import run_helpers as R
from swift_mcore import launch
from swift_mcore.errors import ArgumentError


def launcher_env(monkeypatch, **values):
    for name in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "MAX_RESTARTS",
                 "LOCAL_RANK", "RDZV_ID", "SLURM_JOB_ID", "SLURM_NODEID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"NPROC_PER_NODE": "2", **values}.items():
        monkeypatch.setenv(name, value)
    return launch.torchrun_launch().command(["pt"])


@pytest.mark.parametrize("values, expected, absent", [
    ({}, ["--standalone"], ("--master_port", "--rdzv")),
    ({"MASTER_PORT": "0"}, ["--standalone"], ("--master_port", "--rdzv")),
    ({"MAX_RESTARTS": "2"}, ["--standalone", "--max-restarts=2"], ("--master_port", "--rdzv")),
    ({"MASTER_PORT": "6001"}, ["--master_port=6001", "--node_rank=0"], ("--standalone",)),
    ({"MASTER_PORT": "6001", "MAX_RESTARTS": "1"},
     ["--rdzv-endpoint=127.0.0.1:6001", "--max-restarts=1"], ("--standalone",)),
    ({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"},
     ["--master_port=29500", "--master_addr=10.0.0.1"], ("--standalone",)),
])
def test_the_rendezvous_the_launcher_chooses(monkeypatch, values, expected, absent):
    cmd = launcher_env(monkeypatch, **values)
    assert all(arg in cmd for arg in expected), cmd
    assert not any(arg.startswith(prefix) for arg in cmd for prefix in absent), cmd


@pytest.mark.parametrize("values, message", [
    ({"MASTER_PORT": "http"}, "MASTER_PORT='http' must be a port number (0 to 65535;"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT='70000' must be a port number"),
    ({"MASTER_PORT": "0", "NNODES": "2"}, "MASTER_PORT=0: with NNODES > 1 every node"),
])
def test_a_bad_master_port_is_refused(monkeypatch, values, message):
    with pytest.raises(ArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        launcher_env(monkeypatch, **values)


@pytest.mark.parametrize("values, message", [
    ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK=2 must be below NNODES=2 (the nodes are "
                                        "numbered 0 to 1)"),
    ({"NODE_RANK": "1"}, "NODE_RANK=1 must be below NNODES=1"),
    ({"MASTER_ADDR": "10.0.0.1 --evil"}, "MASTER_ADDR='10.0.0.1 --evil' must be a host name"),
    ({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE='0' must be a positive integer"),
    ({"NPROC_PER_NODE": "80000"}, "NPROC_PER_NODE='80000': at most 1024 processes per "
                                  "machine (one per accelerator, or a few on a CPU node) are "
                                  "accepted"),
    ({"NPROC_PER_NODE": "9" * 5000}, f"NPROC_PER_NODE='{'9' * 5000}': at most 1024 "),
    ({"NPROC_PER_NODE": "1_000"}, "NPROC_PER_NODE='1_000' must be a positive integer"),
    ({"NPROC_PER_NODE": " 2"}, "NPROC_PER_NODE=' 2' must be a positive integer"),
    ({"NNODES": "100000"}, "NNODES='100000': at most 65536 machines are accepted"),
])
def test_a_layout_that_could_never_start_is_refused(monkeypatch, values, message):
    with pytest.raises(ArgumentError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        launcher_env(monkeypatch, **values)


def test_node_rank_beyond_nnodes_exits_2_at_once_instead_of_waiting(tmp_path):
    """Before the check torchrun waited forever for nodes 0 and 1; the timeout turns such a
    regression into a failure."""
    env = R.child_env(NPROC_PER_NODE="1", NNODES="2", NODE_RANK="2", MASTER_PORT="29555")
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "swift_mcore", "pt", *R.TINY,
                             "--train_iters", "2", "--output_dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=R.ROOT, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun too, which would wait on
        proc.communicate()
        raise
    assert proc.returncode == 2, stderr[-3000:]
    assert stderr.strip().splitlines() == [
        "swift-mcore pt: error: NODE_RANK=2 must be below NNODES=2 (the nodes are numbered "
        "0 to 1)"]
    assert not out.exists()


@pytest.mark.slow
def test_two_runs_started_at_once_on_one_machine_both_finish(tmp_path):
    """NPROC_PER_NODE=1 swift-mcore pt ... twice at once, MASTER_PORT unset: with torchrun's
    default port (29500) for both, the second agent could not bind it."""
    env = R.child_env(NPROC_PER_NODE="1", PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen([sys.executable, "-m", "swift_mcore", "pt", *R.TINY,
                               "--global_batch_size", "2", "--train_iters", "2",
                               "--no_save", "--output_dir", str(tmp_path / f"run{i}")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, cwd=R.ROOT) for i in (0, 1)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[-2000:] for o in outputs]
    for i in (0, 1):
        assert sorted(R.losses(tmp_path / f"run{i}")) == [1, 2]


def test_a_failed_rank_is_one_line_with_its_exit_code(tmp_path):
    """A rank that ends with an error of its own (here the CLI's unknown command, exit 2):
    torchrun's ChildFailedError traceback was printed after it; now one line names the rank
    and its code, and the launcher exits with that code."""
    code = ("import sys; from swift_mcore.launch import TorchrunLaunch; "
            "sys.exit(TorchrunLaunch(2, 1, 0, '127.0.0.1', None).run(['no-such-command']))")
    proc = R.run_or_kill([sys.executable, "-c", code], timeout=120, env=R.child_env(),
                         cwd=R.ROOT)
    assert proc is not None, "the launcher did not end"
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "swift-mcore: unknown command 'no-such-command'" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"swift-mcore: rank [01] exited with code 2 \(its error is above\); "
                        r"failed ranks: 0, 1", last), last


SLOW_SAVES = '''"""Test hook: each rank's checkpoint save sleeps SWIFT_TEST_SAVE_DELAY seconds first."""
import os

if os.environ.get("SWIFT_TEST_SAVE_DELAY") and "LOCAL_RANK" in os.environ:
    from swift_mcore import cli

    _train = cli._train

    def _train_with_slow_saves(prog, config):
        import time

        from swift_mcore.checkpointing import manager

        save = manager.CheckpointManager.save

        def slow_save(self, *args, **kwargs):
            time.sleep(float(os.environ["SWIFT_TEST_SAVE_DELAY"]))
            return save(self, *args, **kwargs)

        manager.CheckpointManager.save = slow_save
        return _train(prog, config)

    cli._train = _train_with_slow_saves
'''


@pytest.mark.slow
def test_sigterm_to_the_process_group_waits_for_a_long_save_and_resumes_exactly(tmp_path):
    """What Slurm and Kubernetes do: SIGTERM to the launcher's process group at DP 2, with a
    save that takes longer than torchrun's shutdown timeout (cut to 2 s here, 30 s by
    default). Before, the launcher died at once (-15) and torchrun SIGKILLed the ranks in
    the middle of the save; now the save completes, the run exits 0 with one line, and the
    checkpoint resumes bit for bit like an uninterrupted run."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_SAVES)
    stopped = tmp_path / "stopped"
    flags = ["--train_iters", "40", "--save_steps", "1000"]
    env = R.child_env(NPROC_PER_NODE="2", MASTER_PORT=str(R.free_port()),
                      SWIFT_TEST_SAVE_DELAY="6", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="2",
                      PYTHONPATH=os.pathsep.join([str(hook), str(R.ROOT)]))
    proc = subprocess.Popen([sys.executable, "-m", "swift_mcore", "pt", *R.TINY, *flags,
                             "--output_dir", str(stopped)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=R.ROOT,
                            start_new_session=True)
    try:
        metrics = stopped / "metrics.jsonl"
        for _ in range(2400):  # until iteration 2 is logged (a bound, not a timing)
            if metrics.exists() and '"iteration": 2' in metrics.read_text():
                break
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            R.kill_tree(proc.pid)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "swift-mcore: stopped by SIGTERM: the 2 ranks finished and exited 0")
    got = R.losses(stopped)
    last = max(got)
    assert sorted(got) == list(range(1, last + 1))
    assert (stopped / "checkpoint" / f"iter_{last:07d}").is_dir(), out[-2000:]

    until = ["--exit_interval", str(last + 2), "--no_save"]
    R.run_pt(tmp_path / "whole", *flags, *until, nproc=2)
    R.run_pt(tmp_path / "resumed", *flags, *until, "--resume",
             stopped / "checkpoint" / f"iter_{last:07d}", nproc=2)
    whole, resumed = R.losses(tmp_path / "whole"), R.losses(tmp_path / "resumed")
    assert sorted(resumed) == [last + 1, last + 2]
    assert {it: whole[it] for it in got} == got
    assert {it: whole[it] for it in resumed} == resumed


def test_a_stop_names_the_rank_that_exited_with_its_own_code_before_those_it_killed():
    import signal

    from swift_mcore.runtime.torchrun_agent import stopped_line

    term = -signal.SIGTERM
    assert stopped_line(signal.SIGTERM, {0: term, 1: 2, 2: 0}) == (
        "swift-mcore: stopped by SIGTERM: rank 1 exited with code 2 (its output is above)", 2)
    assert stopped_line(signal.SIGTERM, {0: 0, 1: term}) == (
        "swift-mcore: stopped by SIGTERM: rank 1 was killed by SIGTERM (its output is above)",
        143)
    assert stopped_line(signal.SIGTERM, {0: 0, 1: 0}) == (
        "swift-mcore: stopped by SIGTERM: the 2 ranks finished and exited 0", 0)
