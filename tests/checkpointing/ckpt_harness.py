"""Launches training segments (1 or 2 ranks, one process each, as torchrun would) and
reads what they recorded. Used by the checkpoint tests and benchmarks/kill_resume.py."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from run_helpers import free_port  # noqa: F401  (tests call H.free_port)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ckpt_worker.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY = dict(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=32,
    micro_batch_size=2, global_batch_size=4, lr_warmup_iters=2, lr=1e-3, min_lr=1e-4,
    hidden_dropout=0.1, attention_dropout=0.1, log_interval=1, eval_steps=0,
    tensorboard=False, plot=False, progress_bar=False, log_sample_ids=True, num_workers=0,
)

# The straight two-rank run that test_resume_exact.py's and test_elastic.py's interrupted
# runs are both held to (conftest.straight_run runs it once).
TWO_RANK_RUN = dict(train_iters=12, eval_steps=4, eval_iters=1)

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron "
         "pi rho sigma tau upsilon phi chi psi omega river stone cloud light north south "
         "garden window paper engine silver market winter summer").split()


def write_corpus(path: str, n_docs: int = 48, seed: int = 7, words: int = 22) -> str:
    """A small deterministic jsonl corpus (a few dozen training samples at seq 32)."""
    rnd = random.Random(seed)
    with open(path, "w", encoding="utf-8") as fh:
        for _ in range(n_docs):
            text = " ".join(rnd.choice(WORDS) for _ in range(words)) + "."
            fh.write(json.dumps({"text": text}) + "\n")
    return path




@dataclass
class Segment:
    out: str
    procs: List[subprocess.Popen]
    logs: List[str]
    started: float = field(default_factory=time.time)

    def wait(self, timeout: float) -> List[int]:
        deadline = time.time() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.time())))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"segment in {self.out} timed out after {timeout}s\n"
                                     + self.log_tail())
        return codes

    def signal(self, signum: int, ranks: Optional[List[int]] = None) -> None:
        for r, p in enumerate(self.procs):
            if ranks is None or r in ranks:
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass

    def kill(self) -> None:
        """SIGKILL every process of this segment (each runs in its own process group,
        which also holds the checkpoint writer processes it forked)."""
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass

    def log_tail(self, chars: int = 4000) -> str:
        parts = []
        for path in self.logs:
            try:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    text = fh.read()
            except OSError:
                text = ""
            lines = [ln for ln in text.splitlines() if "warn" not in ln.lower()]
            parts.append(f"--- {path}\n" + "\n".join(lines)[-chars:])
        for rank in range(len(self.procs)):
            for err in records(self.out, "error", rank):
                parts.append(f"--- rank {rank} raised {err['type']}: {err['message']}\n"
                             f"{err['traceback'][-chars:]}")
        return "\n".join(parts)


def launch(out: str, flags: Dict, world_size: int = 1, tag: str = "seg",
           extra: Optional[Dict] = None) -> Segment:
    """``extra``: more spec keys for the worker (e.g. "poison", see ckpt_worker.py)."""
    os.makedirs(out, exist_ok=True)
    spec_path = os.path.join(out, f"spec_{tag}_{time.time_ns()}.json")
    with open(spec_path, "w", encoding="utf-8") as fh:
        json.dump({**(extra or {}), "flags": {**flags, "output_dir": out}}, fh)
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        env = dict(os.environ)
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                   PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
        log = os.path.join(out, f"log_{tag}_r{rank}.txt")
        with open(log, "a", encoding="utf-8") as fh:
            procs.append(subprocess.Popen([sys.executable, WORKER, spec_path], env=env,
                                          stdout=fh, stderr=subprocess.STDOUT, cwd=REPO,
                                          start_new_session=True))
        logs.append(log)
    return Segment(out, procs, logs)


def run(out: str, flags: Dict, world_size: int = 1, timeout: float = 180,
        expect_error: bool = False, tag: str = "seg", extra: Optional[Dict] = None) -> Segment:
    seg = launch(out, flags, world_size, tag, extra)
    codes = seg.wait(timeout)
    seg.kill()  # reap anything left in the segment's process groups
    if expect_error:
        if all(c == 0 for c in codes):
            raise AssertionError(f"expected the segment to fail, it exited {codes}\n"
                                 + seg.log_tail())
    elif any(c != 0 for c in codes):
        raise AssertionError(f"segment exited {codes}\n" + seg.log_tail())
    return seg


# ---- reading records ------------------------------------------------------------------
def read_jsonl(path: str) -> List[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # a line cut by SIGKILL
    return out


def records(out: str, name: str, rank: int = 0) -> List[dict]:
    return read_jsonl(os.path.join(out, f"{name}_r{rank}.jsonl"))


def trace(out: str, world_size: int = 1) -> Dict[int, dict]:
    """iteration -> {loss, lr, consumed, samples: sorted [[id, crc]...] over all ranks}.
    A later record of an iteration (written after a resume) replaces an earlier one: the
    committed history."""
    merged: Dict[int, dict] = {}
    per_rank = [records(out, "trace", r) for r in range(world_size)]
    for r, recs in enumerate(per_rank):
        latest = {}
        for rec in recs:
            latest[rec["iteration"]] = rec
        for it, rec in latest.items():
            entry = merged.setdefault(it, {"loss": rec["loss"], "lr": rec["lr"],
                                           "consumed": rec["consumed"], "samples": []})
            entry["samples"].extend(rec["samples"])
    for entry in merged.values():
        entry["samples"].sort()
    return dict(sorted(merged.items()))


def error(out: str) -> Optional[dict]:
    errs = records(out, "error", 0)
    return errs[-1] if errs else None


def sample_log(out: str) -> List[dict]:
    """The trainer's own audit log (--log_sample_ids)."""
    return read_jsonl(os.path.join(out, "sample_ids.jsonl"))


def tree_snapshot(folder: str) -> Dict[str, tuple]:
    """relative path -> (size, mtime_ns, crc) of every file under ``folder``."""
    import zlib

    snap = {}
    for base, _dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as fh:
                crc = zlib.crc32(fh.read())
            st = os.stat(path)
            snap[os.path.relpath(path, folder)] = (st.st_size, st.st_mtime_ns, crc)
    return snap


# ---- SIGKILL trials (tests/checkpointing/test_resume_signals.py, benchmarks/kill_resume.py) ---
def wait_for(predicate, seg: Segment, timeout: float = 120.0, poll: float = 0.005) -> bool:
    """True once ``predicate()`` holds; False if the segment exited first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        if all(p.poll() is not None for p in seg.procs):
            return predicate()
        time.sleep(poll)
    seg.kill()
    raise AssertionError("timed out waiting\n" + seg.log_tail())


def staging_folders(out: str) -> set:
    """Hidden staging folders of saves in progress (or cut off) under out/checkpoint."""
    root = os.path.join(out, "checkpoint")
    try:
        return {name for name in os.listdir(root) if ".tmp-" in name}
    except FileNotFoundError:
        return set()


def kill_trial(out: str, flags: Dict, mode: str, rnd: random.Random,
               world_size: int = 1) -> dict:
    """Start a segment that resumes (flags should hold resume='auto') and SIGKILL it.

    mode 'mid-save': as soon as a save is being written; 'random': at a random moment once
    training runs; 'launch': at a random moment from the launch (start-up and loading
    included). Returns what happened: the iteration the newest complete checkpoint had
    before the launch, the iteration the segment started from (None if killed before its
    set-up finished) and whether the kill left a half-written save behind.
    """
    from swift_mcore.checkpointing import commit

    root = os.path.join(out, "checkpoint")
    complete = commit.complete_checkpoints(root)
    newest = complete[-1][0] if complete else 0
    before = len(records(out, "setup"))
    stale = staging_folders(out)
    seg = launch(out, flags, world_size, tag="kill")

    def set_up():
        return len(records(out, "setup")) > before

    if mode == "mid-save":
        wait_for(lambda: set_up() and bool(staging_folders(out) - stale), seg)
    elif mode == "random":
        wait_for(set_up, seg)
        time.sleep(rnd.uniform(0.0, 1.0))
    else:
        time.sleep(rnd.uniform(0.0, 4.0))
    finished = all(p.poll() is not None for p in seg.procs)
    seg.kill()
    setups = records(out, "setup")
    started = setups[before]["state"] if len(setups) > before else None
    return {"mode": mode, "newest_complete_before": newest,
            "started_at": started["iteration"] if started else None,
            "consumed_at_start": started["consumed_train_samples"] if started else None,
            "mid_save": bool(staging_folders(out) - stale), "finished_before_kill": finished}


def committed_history(out: str) -> Dict[int, List[int]]:
    """The audit log (--log_sample_ids) as committed: the last record of each iteration."""
    committed: Dict[int, List[int]] = {}
    for rec in sample_log(out):
        committed[rec["iteration"]] = rec["sample_ids"]
    return dict(sorted(committed.items()))


# ---- `swift-mcore pt` itself (tests/checkpointing/test_run_lock.py, test_resume_disk_full.py) ---
CLI_FLAGS = ["--train_iters", "6", "--save_steps", "2", "--log_sample_ids", "true"]


def start_cli(out, *flags, nproc: int = 1, env: Optional[Dict[str, str]] = None
              ) -> subprocess.Popen:
    """`swift-mcore pt` with run_helpers.TINY, in its own session (so that os.killpg reaches
    torchrun and the ranks too); stdout and stderr go to out.stdout / out.stderr."""
    from run_helpers import ROOT, TINY

    full_env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    if nproc > 1:
        full_env.update(NPROC_PER_NODE=str(nproc), MASTER_PORT=str(free_port()))
    cmd = [sys.executable, "-m", "swift_mcore", "pt", *TINY, "--output_dir", str(out),
           *map(str, flags)]
    base = str(out).rstrip("/")
    return subprocess.Popen(cmd, cwd=ROOT, env=full_env, start_new_session=True,
                            stdout=open(base + ".stdout", "w"), stderr=open(base + ".stderr", "w"))


def cli_iterations(out) -> int:
    """Training iterations metrics.jsonl records so far (0 before the first)."""
    return sum(1 for r in read_jsonl(os.path.join(str(out), "metrics.jsonl"))
               if r.get("split") == "train")


def wait_until(predicate, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if proc.poll() is not None or time.time() > deadline:
            raise AssertionError(f"the run exited ({proc.poll()}) or timed out first")
        time.sleep(0.05)


# ---- torchrun with restarts (tests/checkpointing/test_elastic.py) ----------------------
def launch_torchrun(out: str, flags: Dict, nproc: int = 2, max_restarts: int = 3,
                    tag: str = "elastic", env: Optional[Dict[str, str]] = None,
                    agent_args: Optional[List[str]] = None, extra: Optional[Dict] = None
                    ) -> subprocess.Popen:
    """``torchrun --max-restarts N --rdzv-backend c10d`` over ckpt_worker.py, in its own
    session; its output goes to out/log_{tag}.txt. ``agent_args`` replace the default
    rendezvous arguments (e.g. --nnodes 2 --node_rank 1 for a second node agent); ``extra``:
    more spec keys for the worker ("fail", "stall", see ckpt_worker.py)."""
    os.makedirs(out, exist_ok=True)
    spec_path = os.path.join(out, f"spec_{tag}_{time.time_ns()}.json")
    with open(spec_path, "w", encoding="utf-8") as fh:
        json.dump({**(extra or {}), "flags": {**flags, "output_dir": out}}, fh)
    full_env = dict(os.environ)
    full_env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                    PYTHONPATH=REPO + os.pathsep + full_env.get("PYTHONPATH", ""), **(env or {}))
    rdzv = agent_args or ["--rdzv-backend", "c10d",
                          "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--max-restarts={max_restarts}", "--monitor-interval=0.2", *rdzv, WORKER, spec_path]
    log = open(os.path.join(out, f"log_{tag}.txt"), "w", encoding="utf-8")
    return subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            start_new_session=True)


def worker_pid(agent: subprocess.Popen, rank: int, attempt: int, timeout: float = 120.0) -> int:
    """The pid of the worker of ``rank`` that torchrun's ``attempt`` (its restart count)
    started, as soon as it exists."""
    import psutil

    deadline = time.time() + timeout
    while time.time() < deadline:
        if agent.poll() is not None:
            raise AssertionError(f"torchrun exited ({agent.returncode}) before attempt "
                                 f"{attempt} started")
        for child in psutil.Process(agent.pid).children():
            try:
                env = child.environ()
            except (psutil.Error, OSError):
                continue
            if (env.get("RANK") == str(rank)
                    and env.get("TORCHELASTIC_RESTART_COUNT") == str(attempt)):
                return child.pid
        time.sleep(0.02)
    raise AssertionError(f"no worker of rank {rank} in attempt {attempt} after {timeout}s")


def end_session(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of a launched session (the agent, its workers, their writers).
    torchrun starts each worker in a session of its own, out of the agent's process group:
    they are found as descendants, or a failed test would leave them running."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    for child in descendants:
        try:
            child.kill()
        except psutil.Error:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def cli_flags(flags: Dict) -> List[str]:
    """A flags dict (as the worker takes it) as `swift-mcore pt` arguments."""
    argv: List[str] = []
    for name, value in flags.items():
        values = value if isinstance(value, list) else [value]
        argv += [f"--{name}", *(str(v).lower() if isinstance(v, bool) else str(v)
                                for v in values)]
    return argv


def start_node(out: str, flags: Dict, node_rank: int, env: Dict[str, str]) -> subprocess.Popen:
    """`swift-mcore pt` as one node of a multi-node launch (NNODES, NODE_RANK, MASTER_ADDR,
    MASTER_PORT, MAX_RESTARTS in ``env``), in its own session; output in out/node{N}.txt."""
    full_env = dict(os.environ)
    full_env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", NODE_RANK=str(node_rank),
                    PYTHONPATH=REPO + os.pathsep + full_env.get("PYTHONPATH", ""), **env)
    os.makedirs(out, exist_ok=True)
    log = open(os.path.join(out, f"node{node_rank}.txt"), "w", encoding="utf-8")
    cmd = [sys.executable, "-m", "swift_mcore", "pt", *cli_flags({**flags, "output_dir": out})]
    return subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            start_new_session=True)


def descendant_worker(proc: subprocess.Popen, attempt: int, timeout: float = 120.0) -> int:
    """The pid of a torchrun worker under ``proc`` started by ``attempt``."""
    import psutil

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the launcher exited ({proc.returncode})")
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                env = child.environ()
            except (psutil.Error, OSError):
                continue
            if env.get("TORCHELASTIC_RESTART_COUNT") == str(attempt) and "RANK" in env:
                return child.pid
        time.sleep(0.02)
    raise AssertionError(f"no worker of attempt {attempt} after {timeout}s")
