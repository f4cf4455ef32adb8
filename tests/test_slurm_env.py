"""The launcher inside a Slurm job step: the node layout from Slurm's variables, the node
list's first host as MASTER_ADDR, MAX_RESTARTS -> torchrun's c10d rendezvous with restarts;
the sbatch script's flags (scripts/slurm/train.sbatch)."""

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


def test_the_sbatch_script_parses_and_asks_for_requeue_and_the_signal():
    import subprocess

    script = ROOT / "scripts" / "slurm" / "train.sbatch"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    for line in ("#SBATCH --requeue", "#SBATCH --signal=B:USR1@", "#SBATCH --ntasks-per-node=1",
                 "--rdzv-backend c10d", "--resume auto", "scontrol requeue"):
        assert line in text


@pytest.mark.slow
def test_the_sbatch_script_saves_on_the_time_limit_signal_and_requeues(tmp_path):
    """The script under a stand-in Slurm (srun runs its command on this machine, scontrol
    answers the node list and records a requeue): SIGUSR1 to the batch shell -> the ranks
    save (torchrun then exits 1, as after any signal) -> `scontrol requeue <job id>`, exit 0."""
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
    script = str(ROOT / "scripts" / "slurm" / "train.sbatch")

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
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r["iteration"] for r in records if r.get("split") == "train") == stopped
