"""torchrun --max-restarts: a SIGKILLed worker (mid-step, right after an attempt's start,
mid-save) restarts the group, which resumes from the newest complete checkpoint and
finishes with the straight run's losses bit for bit and its samples; a failure that repeats
on every attempt stops the job with the reason; a stalled rank ends within
--distributed_timeout_minutes with its stacks."""

import os
import re
import signal
import time

import pytest

import ckpt_harness as H
from swift_mcore.checkpointing import commit

N = H.TWO_RANK_RUN["train_iters"]
GBS = H.TINY["global_batch_size"]


@pytest.fixture(scope="module")
def elastic_flags(flags):
    # With the evaluations of the straight run shared with test_resume_exact.py.
    return {**flags, **H.TWO_RANK_RUN, "save_steps": 3, "resume": "auto"}


@pytest.fixture(scope="module")
def straight2(straight_run):
    """Two ranks, never interrupted."""
    return straight_run(2, **H.TWO_RANK_RUN)


def newest_complete(out) -> int:
    complete = commit.complete_checkpoints(os.path.join(out, "checkpoint"))
    return complete[-1][0] if complete else 0


@pytest.mark.slow
def test_sigkill_of_one_worker_at_three_moments_restarts_and_resumes_exactly(
        tmp_path, elastic_flags, straight2):
    out = str(tmp_path / "run")
    agent = H.launch_torchrun(out, elastic_flags, max_restarts=3)
    log = os.path.join(out, "log_elastic.txt")
    newest_before = []
    try:
        # attempt 0: mid-step, in iteration 5 or 6 (no save), once iteration 3's is complete
        pid = H.worker_pid(agent, rank=1, attempt=0)
        deadline = time.time() + 120
        while newest_complete(out) < 3 or len(H.records(out, "trace", 1)) < 4:
            assert agent.poll() is None and time.time() < deadline, open(log).read()[-3000:]
            time.sleep(0.01)
        newest_before.append(newest_complete(out))
        os.kill(pid, signal.SIGKILL)
        # attempt 1: right after its start (imports, process group, loading)
        pid = H.worker_pid(agent, rank=1, attempt=1)
        time.sleep(1.5)
        newest_before.append(newest_complete(out))
        os.kill(pid, signal.SIGKILL)
        # attempt 2: in the middle of a save (its staging folder exists)
        stale = H.staging_folders(out)
        pid = H.worker_pid(agent, rank=1, attempt=2)
        deadline = time.time() + 120
        while not H.staging_folders(out) - stale:
            assert agent.poll() is None and time.time() < deadline, open(log).read()[-3000:]
            time.sleep(0.002)
        newest_before.append(newest_complete(out))
        os.kill(pid, signal.SIGKILL)
        code = agent.wait(timeout=240)
    finally:
        H.end_session(agent)
    text = open(log, encoding="utf-8", errors="replace").read()
    assert code == 0, text[-5000:]

    # Every restart resumed from the newest complete checkpoint when its worker died.
    setups = H.records(out, "setup", 0)
    starts = [s["state"]["iteration"] for s in setups]
    assert starts[0] == 0 and starts[-1] == newest_before[-1]
    assert starts[1] == newest_before[0]
    assert set(starts[1:]) <= set(newest_before), (starts, newest_before)
    assert "torchrun attempt 4 of 4: resumed from" in text
    assert f"iter_{newest_before[-1]:07d} (iteration {newest_before[-1]})" in text

    a, b = H.trace(straight2, 2), H.trace(out, 2)
    assert sorted(b) == list(range(1, N + 1))
    for it in range(1, N + 1):
        assert b[it]["samples"] == a[it]["samples"], it
        assert b[it]["loss"] == a[it]["loss"], (it, b[it]["loss"], a[it]["loss"])
    committed = H.committed_history(out)
    ids = sorted(i for it in committed for i in committed[it])
    assert ids == list(range(N * GBS)), "a sample trained twice, or one skipped"


@pytest.mark.slow
def test_a_failure_repeating_on_every_attempt_stops_with_the_reason(tmp_path, elastic_flags):
    out = str(tmp_path / "run")
    agent = H.launch_torchrun(out, {**elastic_flags, "train_iters": 6}, max_restarts=5,
                              extra={"fail": {"iteration": 1, "rank": 1}})
    try:
        code = agent.wait(timeout=240)
    finally:
        H.end_session(agent)
    text = open(os.path.join(out, "log_elastic.txt"), encoding="utf-8",
                errors="replace").read()
    assert code != 0
    assert ("not restarting: attempts 1 and 2 both resumed at iteration 0 and failed in "
            "iteration 1 with RuntimeError: planted failure in iteration #") in text, text[-4000:]
    assert "rank 1 failed in iteration 1 (torchrun attempt 2 of 6)" in text
    # both attempts from scratch; no third one
    assert [s["state"]["iteration"] for s in H.records(out, "setup", 0)] == [0, 0]


@pytest.mark.slow
def test_a_stalled_rank_ends_within_the_timeout_with_its_stacks(tmp_path, elastic_flags):
    out = str(tmp_path / "run")
    timeout_s = 15  # it bounds the start-up's collectives too: above a loaded machine's waits
    agent = H.launch_torchrun(
        out, {**elastic_flags, "train_iters": 6, "save_steps": 100, "resume": None,
              "distributed_timeout_minutes": timeout_s / 60},
        max_restarts=0, extra={"stall": {"iteration": 3, "rank": 1}})
    try:
        deadline = time.time() + 300
        while len(H.records(out, "trace", 0)) < 2:
            assert agent.poll() is None and time.time() < deadline, open(
                os.path.join(out, "log_elastic.txt"), errors="replace").read()[-3000:]
            time.sleep(0.02)
        code = agent.wait(timeout=300)  # bounds a hang only: the log line says why it ended
    finally:
        H.end_session(agent)
    text = open(os.path.join(out, "log_elastic.txt"), encoding="utf-8",
                errors="replace").read()
    assert code != 0
    assert "rank 1 made no progress in iteration 3 for 15 s" in text, text[-4000:]
    assert "in train_step" in text and "ckpt_worker.py" in text  # the stalled rank's stack


@pytest.mark.slow
def test_sigterm_to_the_process_group_with_loader_workers_saves_and_exits_zero(tmp_path, corpus):
    """Slurm and torchrun signal the whole process group: the loader workers must leave the
    stop to the trainer (data/loader.py), which saves and exits 0."""
    out = tmp_path / "run"
    proc = H.start_cli(out, "--train_iters", "200", "--save_steps", "100", "--num_workers",
                       "2", "--dataset", corpus, "--split", "90,10,0")
    try:
        H.wait_until(lambda: H.cli_iterations(out) >= 2, proc)
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        H.end_session(proc)
    stderr = open(str(out) + ".stderr").read()
    assert code == 0, stderr[-3000:]
    assert "DataLoader worker" not in stderr
    stdout = open(str(out) + ".stdout").read()
    assert "(stop signal received)" in stdout
    stopped = int(stdout.split("finished at iteration ")[1].split()[0])
    assert commit.check_complete(os.path.join(str(out), "checkpoint",
                                              f"iter_{stopped:07d}")) is None


@pytest.mark.slow
def test_two_node_agents_on_localhost_restart_and_resume_exactly(tmp_path, elastic_flags,
                                                                 straight2):
    """NNODES=2 NPROC_PER_NODE=1 MAX_RESTARTS=1 swift-mcore pt ... twice (NODE_RANK 0 and 1,
    one output_dir as on a shared file system): a worker of node 1 is SIGKILLed mid-run;
    both agents restart their workers, which resume and finish exactly."""
    out = str(tmp_path / "run")
    env = {"NNODES": "2", "NPROC_PER_NODE": "1", "MAX_RESTARTS": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(H.free_port()),
           "RDZV_ID": f"test-{os.getpid()}"}
    nodes = [H.start_node(out, elastic_flags, rank, env) for rank in (0, 1)]
    try:
        pid = H.descendant_worker(nodes[1], attempt=0)
        deadline = time.time() + 120
        while newest_complete(out) < 3:
            assert all(n.poll() is None for n in nodes) and time.time() < deadline
            time.sleep(0.01)
        # Frozen first: node 0's rank then cannot pass its next collective. Had the run got
        # to its end, node 0's agent would wait in torchrun's exit barrier (300 s) while
        # node 1's waits for a rendezvous that never comes (docs/launch.md): the kill must
        # land at least one iteration of collectives before the end.
        os.kill(pid, signal.SIGSTOP)
        logged = [r["iteration"] for r in H.read_jsonl(os.path.join(out, "metrics.jsonl"))
                  if r.get("split") == "train"]
        assert max(logged, default=0) <= N - 2, f"the run was at iteration {logged[-1]}"
        os.kill(pid, signal.SIGKILL)
        codes = [n.wait(timeout=240) for n in nodes]
    finally:
        for n in nodes:
            H.end_session(n)
    logs = [open(os.path.join(out, f"node{r}.txt"), errors="replace").read() for r in (0, 1)]
    assert codes == [0, 0], (logs[0][-3000:], logs[1][-3000:])
    assert "torchrun attempt 2 of 2: resumed from" in logs[0] + logs[1]
    a = H.trace(straight2, 2)
    metrics = [r for r in H.read_jsonl(os.path.join(out, "metrics.jsonl"))
               if r.get("split") == "train"]
    losses = {r["iteration"]: r["loss"] for r in metrics}  # a redone iteration: the last
    assert sorted(losses) == list(range(1, N + 1))
    assert all(losses[it] == a[it]["loss"] for it in losses), (losses, a)
    committed = H.committed_history(out)
    assert [committed[it] for it in range(1, N + 1)] == [
        sorted(i for i, _crc in a[it]["samples"]) for it in range(1, N + 1)]


@pytest.mark.parametrize("agent", ["torch.distributed.run", "swift_mcore.runtime.torchrun_agent"])
def test_bad_flags_under_torchrun_with_restarts_end_the_job_at_once(tmp_path, agent):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", agent, "--nproc_per_node=2",
           "--max-restarts=3", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{H.free_port()}",
           "-m", "swift_mcore", "pt", "--train_iters", "3", "--lr_warmup_iters", "5",
           "--output_dir", str(tmp_path / "run")]
    env = {**os.environ, "PYTHONPATH": H.REPO, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=H.REPO)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "--lr_warmup_iters (5) must be smaller" in text
    assert "not restarting: swift-mcore pt: the flags are refused" in text
    assert "restart" not in text.split("not restarting")[0].lower()  # one attempt only
    if agent == "swift_mcore.runtime.torchrun_agent":  # the launcher's: the rank's code
        assert proc.returncode == 2, text[-3000:]
        # the rank that stopped the agent, or another that refused the flags before the stop
        assert re.search(r"swift-mcore: stopped by SIGTERM: rank [01] exited with code 2 ", text)
        assert "Traceback" not in text


@pytest.mark.parametrize("argv, agent", [
    (["/venv/bin/python", "-m", "swift_mcore.runtime.torchrun_agent", "--nnodes", "2"], True),
    (["python3", "-u", "-X", "faulthandler", "-m", "torch.distributed.run", "-m", "x"], True),
    (["python", "-mswift_mcore.runtime.torchrun_agent"], True),
    (["/venv/bin/python", "/venv/bin/torchrun", "--nproc_per_node=2"], True),
    (["/usr/local/bin/torchrun", "--standalone"], True),
    # a parent that only mentions torchrun is not an agent: SIGTERM would end it
    (["bash", "/jobs/torchrun_wrapper.sh"], False),
    (["python", "train.py", "--output_dir", "/runs/torchrun-7"], False),
    (["python", "-m", "swift_mcore", "pt", "--output_dir", "/runs/torchrun_agent"], False),
    (["python", "-c", "import torchrun"], False),
    ([""], False),
])
def test_the_agent_a_rank_stops_is_read_from_its_command_not_a_substring(argv, agent):
    from swift_mcore.runtime import elastic

    assert elastic.is_agent_command(argv + [""]) is agent  # /proc's line ends in a NUL


def test_a_parent_whose_arguments_mention_torchrun_is_not_sent_the_stop():
    import subprocess
    import sys

    from swift_mcore.runtime import elastic

    parent = subprocess.Popen([sys.executable, "-c", "import time; print(1, flush=True); "
                               "time.sleep(60)", "--output_dir", "/runs/torchrun-7"],
                              stdout=subprocess.PIPE)
    try:
        parent.stdout.readline()  # it runs: its command line is in /proc
        assert "/runs/torchrun-7" in open(f"/proc/{parent.pid}/cmdline").read()
        assert not elastic._is_torchrun(parent.pid)
    finally:
        parent.kill()
        parent.wait()
