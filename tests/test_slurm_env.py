"""The launcher inside a Slurm job step: the node layout from Slurm's variables, the node
list's first host as MASTER_ADDR, MAX_RESTARTS -> torchrun's c10d rendezvous with restarts;
the sbatch script (scripts/slurm/train.sbatch): its flags, its flow under a stand-in Slurm and
agent (the exit codes, the requeue after the time limit signal, the bound on the save), and
a real run's save on the time limit signal."""

import os
from pathlib import Path

import pytest

from swift_mcore import launch
from swift_mcore.errors import ArgumentError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("nodelist, first", [
    ("gpu[03-05,9],cpu1", "gpu03"), ("node1,node2", "node1"), ("n[7]", "n7"),
    ("rack1-[001-004]-ib", "rack1-001-ib"), ("solo", "solo")])
def test_first_host_of_a_slurm_node_list(nodelist, first):
    assert launch.first_host(nodelist) == first


def slurm_env(monkeypatch, **extra):
    for name in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "MAX_RESTARTS",
                 "LOCAL_RANK", "RDZV_ID"):
        monkeypatch.delenv(name, raising=False)
    values = {"SLURM_JOB_ID": "4242", "SLURM_NODEID": "1", "SLURM_NNODES": "3",
              "SLURM_JOB_NODELIST": "gpu[07-09]", "NPROC_PER_NODE": "8", **extra}
    for name, value in values.items():
        monkeypatch.setenv(name, value)


def test_the_launcher_takes_the_node_layout_from_slurm(monkeypatch):
    slurm_env(monkeypatch, MAX_RESTARTS="2")
    run = launch.torchrun_launch()
    assert (run.nnodes, run.node_rank, run.master_addr, run.world_size) == (3, 1, "gpu07", 24)
    cmd = run.command(["pt", "--train_iters", "5"])
    assert "--nnodes=3" in cmd and "--max-restarts=2" in cmd
    assert "--rdzv-backend=c10d" in cmd and "--rdzv-endpoint=gpu07:29500" in cmd
    assert "--rdzv-id=4242" in cmd  # the job id: every node agent joins the same rendezvous
    assert cmd[-5:] == ["-m", "swift_mcore", "pt", "--train_iters", "5"]


def test_explicit_variables_win_over_slurm_and_no_restarts_keeps_the_static_launch(
        monkeypatch):
    slurm_env(monkeypatch, NNODES="2", NODE_RANK="0", MASTER_ADDR="10.0.0.1",
              MASTER_PORT="6000")
    run = launch.torchrun_launch()
    cmd = run.command(["pt"])
    assert (run.nnodes, run.node_rank, run.master_addr) == (2, 0, "10.0.0.1")
    assert "--node_rank=0" in cmd and "--master_addr=10.0.0.1" in cmd
    assert not any(c.startswith("--rdzv") or c.startswith("--max-restarts") for c in cmd)


@pytest.mark.parametrize("name, value", [("MAX_RESTARTS", "-1"), ("MAX_RESTARTS", "two"),
                                         ("NNODES", "0")])
def test_bad_launch_variables_are_refused(monkeypatch, name, value):
    slurm_env(monkeypatch)
    monkeypatch.setenv(name, value)
    with pytest.raises(ArgumentError, match=f"^{name}="):
        launch.torchrun_launch()


def test_outside_slurm_nothing_is_taken_from_it(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert launch.slurm_layout(dict(os.environ)) == {}


SCRIPT = ROOT / "scripts" / "slurm" / "train.sbatch"


def test_the_sbatch_script_parses_and_asks_for_requeue_and_the_signal():
    import subprocess

    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    text = SCRIPT.read_text()
    for line in ("#SBATCH --requeue", "#SBATCH --signal=B:USR1@", "#SBATCH --ntasks-per-node=1",
                 "--rdzv-backend c10d", "--resume auto", "scontrol requeue"):
        assert line in text
    # torchrun's own agent SIGKILLs the ranks mid-save and exits 1 after any stop signal
    code = [line.split("#")[0] for line in text.splitlines()]
    assert "python -m swift_mcore.runtime.torchrun_agent" in text
    assert not any("torch.distributed.run" in line or "torchrun " in line for line in code)


def fake_slurm(tmp_path, agent: str, **env):
    """The batch script under stand-ins: srun runs its command here, scontrol answers the
    node list and records the rest, and `python` is an agent that records its arguments
    and then behaves as ``agent`` says: ``exit:N`` (exit N at once), ``stop:N`` (run until
    SIGTERM, then exit N: the ranks' code after their save), ``hang`` (ignore SIGTERM: a
    save that never ends). Returns the running script."""
    import signal
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        "#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\nexec \"$@\"\n")
    (bin_dir / "scontrol").write_text(
        "#!/bin/bash\nif [ \"$1\" = show ]; then echo node1; "
        f"else echo \"$@\" >> {tmp_path}/scontrol.log; fi\n")
    (bin_dir / "python").write_text(f"""#!/bin/bash
printf '%s\\n' "$@" > {tmp_path}/agent.args
case "$FAKE_AGENT" in
  exit:*) exit "${{FAKE_AGENT#exit:}}" ;;
  stop:*) trap "exit ${{FAKE_AGENT#stop:}}" TERM ;;
  hang) trap '' TERM ;;
esac
touch {tmp_path}/agent.ready
while :; do sleep 0.05; done
""")
    for name in ("python", "srun", "scontrol"):
        (bin_dir / name).chmod(0o755)
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_AGENT": agent,
                "SLURM_JOB_ID": "777", "SLURM_NNODES": "2", "SLURM_JOB_NAME": "t",
                "SLURM_JOB_NODELIST": "node[1-2]", "NPROC_PER_NODE": "4",
                "OUTPUT_DIR": str(tmp_path / "run"), **env}
    # a file, not a pipe: the agent that ignores SIGTERM outlives the script
    with open(tmp_path / "job.out", "w") as log:
        job = subprocess.Popen(["bash", str(SCRIPT), "--train_iters", "9"], env=full_env,
                               cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    job.signal_after_start = lambda sig: _signal_when_ready(job, tmp_path, sig)
    job.end = lambda: _end(job, signal)
    return job


def _signal_when_ready(job, tmp_path, sig):
    import time

    while not (tmp_path / "agent.ready").exists():  # the agent's traps are set
        assert job.poll() is None, (tmp_path / "job.out").read_text()
        time.sleep(0.05)
    os.kill(job.pid, sig)


def _end(job, signal):
    try:
        os.killpg(job.pid, signal.SIGKILL)  # the fake agent that ignores SIGTERM
    except ProcessLookupError:
        pass


def finished(job, tmp_path):
    try:
        job.wait(timeout=60)
    finally:
        job.end()
    out = (tmp_path / "job.out").read_text()
    requeues = tmp_path / "scontrol.log"
    return job.returncode, out, requeues.read_text().split() if requeues.exists() else []


def test_the_sbatch_script_starts_swift_mcores_agent_and_exits_with_its_code(tmp_path):
    job = fake_slurm(tmp_path, "exit:3")
    code, out, requeues = finished(job, tmp_path)
    args = (tmp_path / "agent.args").read_text().splitlines()
    assert args[:2] == ["-m", "swift_mcore.runtime.torchrun_agent"]
    assert args[2:13] == ["--nnodes", "2", "--nproc_per_node", "4", "--max-restarts", "3",
                          "--rdzv-backend", "c10d", "--rdzv-endpoint", "node1:29500",
                          "--rdzv-id"]
    assert args[13:] == ["777", "-m", "swift_mcore", "pt", "--train_iters", "9",
                         "--output_dir", str(tmp_path / "run"), "--resume", "auto"]
    assert (code, requeues) == (3, []), out


@pytest.mark.parametrize("ranks_code", [0, 2])
def test_the_time_limit_signal_requeues_once_the_agent_ended_with_the_ranks_code(
        tmp_path, ranks_code):
    """SIGUSR1 -> SIGTERM to the step -> the agent exits with the ranks' code (0: they
    saved) -> `scontrol requeue <job id>`, and the script exits with that code."""
    import signal

    job = fake_slurm(tmp_path, f"stop:{ranks_code}")
    job.signal_after_start(signal.SIGUSR1)
    code, out, requeues = finished(job, tmp_path)
    assert (code, requeues) == (ranks_code, ["requeue", "777"]), out
    said = ("the ranks saved before the time limit" if ranks_code == 0
            else f"the step ended with code {ranks_code} after the time limit signal")
    assert f"train.sbatch: {said}" in out


def test_a_save_that_outlasts_stop_timeout_still_requeues_before_the_time_limit(tmp_path):
    import signal

    job = fake_slurm(tmp_path, "hang", STOP_TIMEOUT="1")
    job.signal_after_start(signal.SIGUSR1)
    code, out, requeues = finished(job, tmp_path)
    assert (code, requeues) == (124, ["requeue", "777"]), out
    assert "did not end within STOP_TIMEOUT=1s" in out


@pytest.mark.parametrize("ranks_code", [0, 1])
def test_a_stop_signal_ends_the_script_with_the_agents_code_without_a_requeue(
        tmp_path, ranks_code):
    """Pre-emption or scancel (SIGTERM to the batch shell): Slurm requeues a pre-empted
    job itself; the script passes the stop on and exits with the agent's code, not the
    128 + 15 of the `wait` the signal interrupted."""
    import signal

    job = fake_slurm(tmp_path, f"stop:{ranks_code}")
    job.signal_after_start(signal.SIGTERM)
    code, out, requeues = finished(job, tmp_path)
    assert (code, requeues) == (ranks_code, []), out


@pytest.mark.slow
def test_the_sbatch_script_saves_on_the_time_limit_signal_and_requeues(tmp_path):
    """The script under a stand-in Slurm (srun runs its command on this machine, scontrol
    answers the node list and records a requeue): SIGUSR1 to the batch shell -> the ranks
    save (swift-mcore's agent then exits 0) -> `scontrol requeue <job id>`, exit 0."""
    import json
    import signal
    import subprocess
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "checkpointing"))
    import ckpt_harness as H

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f"#!/bin/bash\nexec {sys.executable} \"$@\"\n")
    (bin_dir / "srun").write_text(
        "#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\nexec \"$@\"\n")
    (bin_dir / "scontrol").write_text(
        "#!/bin/bash\nif [ \"$1\" = show ]; then echo 127.0.0.1; "
        f"else echo \"$@\" >> {tmp_path}/scontrol.log; fi\n")
    for name in ("python", "srun", "scontrol"):
        (bin_dir / name).chmod(0o755)
    corpus = H.write_corpus(str(tmp_path / "corpus.jsonl"), n_docs=20)
    out = tmp_path / "run"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": H.REPO,
           "PYTHONWARNINGS": "ignore", "SLURM_JOB_ID": "777", "SLURM_NNODES": "1",
           "SLURM_JOB_NAME": "t", "SLURM_JOB_NODELIST": "127.0.0.1", "NPROC_PER_NODE": "2",
           "MASTER_PORT": str(H.free_port()), "OUTPUT_DIR": str(out)}
    flags = H.cli_flags({**{k: v for k, v in H.TINY.items() if k != "log_sample_ids"},
                         "dataset": [corpus], "split": "90,10,0", "train_iters": 400,
                         "save_steps": 1000})
    script = str(SCRIPT)

    def start():
        log = open(tmp_path / "job.out", "a")
        return subprocess.Popen(["bash", script, *flags], env=env, cwd=H.REPO, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

    job = start()
    try:
        H.wait_until(lambda: H.cli_iterations(out) >= 3, job, timeout=120)
        os.kill(job.pid, signal.SIGUSR1)
        code = job.wait(timeout=120)
    finally:
        H.end_session(job)
    log = (tmp_path / "job.out").read_text(errors="replace")
    assert code == 0, log[-3000:]
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "777"]
    stopped = int(log.split("finished at iteration ")[1].split()[0])
    assert "(stop signal received)" in log and 3 <= stopped < 400
    assert "swift-mcore: stopped by SIGTERM: the 2 ranks finished and exited 0" in log
    assert "train.sbatch: the ranks saved before the time limit; requeueing job 777" in log
    assert "Traceback" not in log
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r["iteration"] for r in records if r.get("split") == "train") == stopped


def test_a_stop_timeout_that_is_not_a_number_of_seconds_is_refused_before_the_step(tmp_path):
    job = fake_slurm(tmp_path, "exit:0", STOP_TIMEOUT="four")
    code, out, requeues = finished(job, tmp_path)
    assert (code, requeues) == (2, []), out
    assert out.strip() == ("train.sbatch: STOP_TIMEOUT='four' must be a whole number of seconds "
                           "(below the lead time of --signal, 300 s here)")
    assert not (tmp_path / "agent.args").exists()
