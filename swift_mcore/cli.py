"""`swift-mcore pt|sft ...`: parses flags (YAML first), validates, relaunches under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import List, Optional

USAGE = """usage: swift-mcore <command> [config.yaml] [--flag value ...]

commands:
{commands}

`swift-mcore <command> --help` lists every flag with its default.
Several ranks: NPROC_PER_NODE=2 swift-mcore pt ...  (also NNODES, NODE_RANK, MASTER_ADDR,
MASTER_PORT), or torchrun --nproc_per_node 2 -m swift_mcore pt ...
"""

def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = USAGE.format(commands="\n".join(
        f"  {name:<12}{summary}" for name, (_, summary) in COMMANDS.items()))
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"swift-mcore: unknown command '{command}'; choose one of: "
              f"{', '.join(COMMANDS)}\n\n{usage}", file=sys.stderr)
        return 2
    return COMMANDS[command][0](rest)


def run_pretrain(argv: List[str]) -> int:
    from .arguments import PretrainArguments

    return run_training(argv, PretrainArguments)


def run_sft(argv: List[str]) -> int:
    from .arguments import SftArguments

    return run_training(argv, SftArguments)


def run_training(argv: List[str], cls) -> int:
    """pt and sft: the same Trainer; the arguments class decides the data."""
    from .errors import ArgumentError
    from .arguments import parse_args
    from .arguments.paths import check_run_outputs
    from .errors import CheckpointError

    prog = f"swift-mcore {cls.COMMAND}"
    launch = torchrun_launch()
    try:
        args = parse_args(argv, prog=prog, cls=cls)
        args.validate(world_size=launch.world_size if launch else None)
        check_run_outputs(args)
    except ArgumentError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    if launch:
        return launch.run([cls.COMMAND, *argv])

    from ._quiet import quiet_third_party
    from .runtime import distributed
    from .training.trainer import Trainer

    quiet_third_party()
    try:
        Trainer(args).train()
    except (ArgumentError, CheckpointError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    distributed.shutdown()
    return 0


class TorchrunLaunch:
    """ms-swift's convention: NPROC_PER_NODE (and NNODES, NODE_RANK, MASTER_ADDR,
    MASTER_PORT) in the environment means "run me under torchrun"."""

    def __init__(self, nproc: int, nnodes: int, node_rank: int, master_addr: str,
                 master_port: str):
        self.nproc, self.nnodes, self.node_rank = nproc, nnodes, node_rank
        self.master_addr, self.master_port = master_addr, master_port
        self.world_size = nproc * nnodes

    def command(self, subcommand_argv: List[str]) -> List[str]:
        return [
            sys.executable, "-m", "torch.distributed.run",
            f"--nproc_per_node={self.nproc}", f"--nnodes={self.nnodes}",
            f"--node_rank={self.node_rank}", f"--master_addr={self.master_addr}",
            f"--master_port={self.master_port}",
            "-m", "swift_mcore", *subcommand_argv,
        ]

    def run(self, subcommand_argv: List[str]) -> int:
        env = dict(os.environ)
        for name in ("NPROC_PER_NODE", "NNODES", "NODE_RANK"):
            env.pop(name, None)  # the children are the ranks; they must not relaunch
        return subprocess.call(self.command(subcommand_argv), env=env)


def torchrun_launch() -> Optional[TorchrunLaunch]:
    if "NPROC_PER_NODE" not in os.environ or "LOCAL_RANK" in os.environ:
        return None

    def env_int(name, default):
        value = os.environ.get(name, default)
        try:
            number = int(value)
        except ValueError:
            number = 0
        if number <= 0 and name != "NODE_RANK" or number < 0:
            raise SystemExit(f"swift-mcore: error: {name}={value!r} must be a positive integer")
        return number

    return TorchrunLaunch(
        nproc=env_int("NPROC_PER_NODE", "1"), nnodes=env_int("NNODES", "1"),
        node_rank=env_int("NODE_RANK", "0"),
        master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=os.environ.get("MASTER_PORT", "29500"))


def run_command(name: str, argv: List[str], parse, work, shutdown: bool = True) -> int:
    """A one-process command (preprocess, export, infer): ``work(parse(argv))``. Bad input,
    an ArgumentError or a CheckpointError, is one line on stderr and exit code 2."""
    from .errors import ArgumentError, CheckpointError

    try:
        args = parse(argv)
    except ArgumentError as err:
        print(f"swift-mcore {name}: error: {err}", file=sys.stderr)
        return 2
    from ._quiet import quiet_third_party

    quiet_third_party()
    try:
        work(args)
    except (ArgumentError, CheckpointError) as err:
        print(f"swift-mcore {name}: error: {err}", file=sys.stderr)
        return 2
    if shutdown:
        from .runtime import distributed

        distributed.shutdown()
    return 0


def _lazy(module: str):
    """A command's main(argv), imported only when that command runs (imports cost seconds)."""

    def run(argv: List[str]) -> int:
        import importlib

        return importlib.import_module(module).main(argv)

    return run


# name -> (function taking the arguments after the name, one-line summary)
COMMANDS = {
    "pt": (run_pretrain, "pretrain a GPT model (default: a small Llama-style model on the "
                         "embedded corpus)"),
    "sft": (run_sft, "finetune on conversations (messages or query/response; jsonl, json, "
                     "parquet, datasets folders)"),
    "preprocess": (_lazy("swift_mcore.preprocess"),
                   "tokenize text files (jsonl, parquet, csv, txt, datasets) into .bin/.idx"),
    "export": (_lazy("swift_mcore.export"),
               "convert a checkpoint to a Hugging Face folder (--to_hf) or back (--to_mcore)"),
    "infer": (_lazy("swift_mcore.infer"),
              "generate text from a Hugging Face folder or a checkpoint"),
}


def entry_point() -> None:
    """Console script: flush and leave without running interpreter teardown (commands shut
    their process groups down themselves; see runtime.distributed.exit_process)."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
