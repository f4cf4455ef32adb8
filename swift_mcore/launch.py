"""Starting processes: swift-mcore's torchrun launcher (NPROC_PER_NODE...) and a one-process
command's error handling (the export child of a save is runtime/export_child.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from typing import List, Optional

from .errors import ArgumentError


class TorchrunLaunch:
    """ms-swift's convention: NPROC_PER_NODE (and NNODES, NODE_RANK, MASTER_ADDR,
    MASTER_PORT) in the environment means "run me under torchrun". MAX_RESTARTS=N: torchrun
    restarts the whole group up to N times when a worker fails (docs/launch.md)."""

    def __init__(self, nproc: int, nnodes: int, node_rank: int, master_addr: str,
                 master_port: Optional[str], max_restarts: int = 0,
                 rdzv_id: str = "swift-mcore"):
        self.nproc, self.nnodes, self.node_rank = nproc, nnodes, node_rank
        self.master_addr, self.master_port = master_addr, master_port
        self.max_restarts, self.rdzv_id = max_restarts, rdzv_id
        self.world_size = nproc * nnodes

    def command(self, subcommand_argv: List[str]) -> List[str]:
        restarts = [f"--max-restarts={self.max_restarts}"] if self.max_restarts else []
        port = self.master_port or "29500"  # torchrun's default; every node must agree on it
        if self.nnodes == 1 and self.master_port is None:
            # One machine and no port asked for: torchrun's standalone rendezvous on a port
            # the kernel picks, so that two runs started at once do not both take 29500.
            where = ["--standalone", *restarts]
        elif self.max_restarts:
            # Restarts need torchrun's c10d rendezvous: the agents of all nodes stop their
            # workers before any attempt starts again (the static one restarts each node on
            # its own). Its node ranks follow the order of joining, not NODE_RANK.
            where = ["--rdzv-backend=c10d",
                     f"--rdzv-endpoint={self.master_addr}:{port}",
                     f"--rdzv-id={self.rdzv_id}", *restarts]
        else:
            where = [f"--node_rank={self.node_rank}", f"--master_addr={self.master_addr}",
                     f"--master_port={port}"]
        return [
            sys.executable, "-m", "swift_mcore.runtime.torchrun_agent",
            f"--nproc_per_node={self.nproc}", f"--nnodes={self.nnodes}", *where,
            "-m", "swift_mcore", *subcommand_argv,
        ]

    def run(self, subcommand_argv: List[str], lock=None) -> int:
        """torchrun's agent (runtime/torchrun_agent.py); ``lock`` (this launcher's run lock)
        is handed to the ranks, and the agent keeps it open too, so it stays held while any
        part of the run lives. Its exit code is the run's.

        A stop signal to this process, or to its process group (what Slurm and Kubernetes
        send), reaches the agent once: the agent runs in a session of its own, and this
        process passes SIGTERM and SIGINT on to it and waits for it to end, the ranks'
        save included (without that it would end at once, and a container whose first
        process it is with it)."""
        from .runtime import run_lock

        env = dict(os.environ)
        for name in ("NPROC_PER_NODE", "NNODES", "NODE_RANK", "MAX_RESTARTS"):
            env.pop(name, None)  # the children are the ranks; they must not relaunch
        env.update(run_lock.child_env(lock))
        fds = (lock.fd,) if lock is not None and lock.fd is not None else ()
        env["SWIFT_MCORE_LAUNCHER_PID"] = str(os.getpid())  # the agent stops when it dies
        agent = subprocess.Popen(self.command(subcommand_argv), env=env, pass_fds=fds,
                                 start_new_session=True)

        def forward(signum, frame):
            try:
                agent.send_signal(signum)
            except ProcessLookupError:
                pass

        previous = {signum: signal.signal(signum, forward)
                    for signum in (signal.SIGTERM, signal.SIGINT)}
        try:
            code = agent.wait()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell says


# Sanity bounds far above any real layout: torchrun starts NPROC_PER_NODE processes here at
# once (each a Python with torch, hundreds of MB), so a typo of 80000 for 8 would exhaust
# the machine before any rank could report it.
LAYOUT_LIMITS = {
    "NPROC_PER_NODE": (1024, "processes per machine (one per accelerator, or a few on a CPU "
                             "node)"),
    "NNODES": (65536, "machines"),
}


def torchrun_launch() -> Optional[TorchrunLaunch]:
    """The launcher the environment asks for (None: run in this process). A layout that
    could never start (NODE_RANK >= NNODES, a bad number or port) is an ArgumentError."""
    if "NPROC_PER_NODE" not in os.environ or "LOCAL_RANK" in os.environ:
        return None

    def env_int(name, default):
        value = os.environ.get(name, default)
        zero_ok = name in ("NODE_RANK", "MAX_RESTARTS")
        # decimal digits only: int() would also take "1_000", " 8" and other scripts' digits
        # (and raise on 5,000 of them)
        number = (-1 if not re.fullmatch(r"[0-9]+", value)
                  else int(value) if len(value) <= 18 else 10 ** 18)
        if number < 0 or number == 0 and not zero_ok:
            kind = "a non-negative" if zero_ok else "a positive"
            raise ArgumentError(f"{name}={value!r} must be {kind} integer")
        if name in LAYOUT_LIMITS and number > LAYOUT_LIMITS[name][0]:
            limit, what = LAYOUT_LIMITS[name]
            raise ArgumentError(f"{name}={value!r}: at most {limit} {what} are accepted")
        return number

    slurm = slurm_layout(os.environ)
    nnodes = env_int("NNODES", slurm.get("NNODES", "1"))
    node_rank = env_int("NODE_RANK", slurm.get("NODE_RANK", "0"))
    if node_rank >= nnodes:
        # torchrun would wait forever for node ranks that can never join
        raise ArgumentError(f"NODE_RANK={node_rank} must be below NNODES={nnodes} (the nodes "
                            f"are numbered 0 to {nnodes - 1})")
    master_addr = os.environ.get("MASTER_ADDR") or slurm.get("MASTER_ADDR", "127.0.0.1")
    if any(c.isspace() or not c.isprintable() for c in master_addr):
        raise ArgumentError(f"MASTER_ADDR={master_addr!r} must be a host name or address")
    return TorchrunLaunch(
        nproc=env_int("NPROC_PER_NODE", "1"),
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port(os.environ.get("MASTER_PORT"), nnodes),
        max_restarts=env_int("MAX_RESTARTS", "0"),
        rdzv_id=os.environ.get("RDZV_ID") or os.environ.get("SLURM_JOB_ID") or "swift-mcore")


def master_port(value: Optional[str], nnodes: int) -> Optional[str]:
    """MASTER_PORT checked; None (unset, or 0 on one node): any free port will do."""
    if value is None or value == "":
        return None
    if not value.isdigit() or not 0 <= int(value) <= 65535:
        raise ArgumentError(f"MASTER_PORT={value!r} must be a port number "
                         f"(0 to 65535; 0 or unset: a free port on one machine)")
    if int(value) == 0:
        if nnodes > 1:
            raise ArgumentError("MASTER_PORT=0: with NNODES > 1 every node "
                             "must be given the same port (1 to 65535)")
        return None
    return value


def slurm_layout(env) -> dict:
    """Inside a Slurm job step (srun, one task per node): NNODES, NODE_RANK and MASTER_ADDR
    as Slurm gives them (SLURM_NNODES, SLURM_NODEID, the first host of SLURM_JOB_NODELIST);
    the defaults where the environment does not set these itself. {} outside Slurm."""
    if "SLURM_JOB_ID" not in env or "SLURM_NODEID" not in env:
        return {}
    layout = {"NODE_RANK": env["SLURM_NODEID"]}
    nnodes = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")
    if nnodes:
        layout["NNODES"] = nnodes
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if nodelist:
        layout["MASTER_ADDR"] = first_host(nodelist)
    return layout


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: "gpu[03-05,9],cpu1" -> "gpu03" (what
    `scontrol show hostnames` prints first)."""
    import re

    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", nodelist.strip())
    prefix, ranges, suffix = match.groups()
    if not ranges:
        return prefix + suffix
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def run_command(name: str, argv: List[str], parse, work, shutdown: bool = True) -> int:
    """A one-process command (preprocess, export, infer): ``work(parse(argv))``. Bad input,
    an ArgumentError, a CheckpointError or an OutputError, is one line on stderr and exit
    code 2."""
    from .errors import ArgumentError, CheckpointError, OutputError

    try:
        args = parse(argv)
    except ArgumentError as err:
        print(f"swift-mcore {name}: error: {err}", file=sys.stderr)
        return 2
    from ._quiet import quiet_third_party

    quiet_third_party()
    try:
        work(args)
    except (ArgumentError, CheckpointError, OutputError) as err:
        print(f"swift-mcore {name}: error: {err}", file=sys.stderr)
        return 2
    if shutdown:
        from .runtime import distributed

        distributed.shutdown()
    return 0
