"""`swift-mcore <command>`: the command table; pt, sft and rlhf parse, resolve, then train (or
relaunch under torchrun)."""

from __future__ import annotations

import os
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
    if not {"-h", "--help"} & set(rest):
        from .runtime import cpu

        cpu.before_import()
    return COMMANDS[command][0](rest)


def run_pretrain(argv: List[str]) -> int:
    from .arguments import RunArguments

    return run_training(argv, RunArguments)


def run_sft(argv: List[str]) -> int:
    from .arguments import SftArguments

    return run_training(argv, SftArguments)


def run_rlhf(argv: List[str]) -> int:
    from .arguments import RlhfArguments

    return run_training(argv, RlhfArguments)


def run_training(argv: List[str], cls) -> int:
    """pt, sft and rlhf: the same loop; the arguments class decides the data (and rlhf its
    Trainer, training/rlhf_trainer.py). Under a launcher
    (NPROC_PER_NODE...) this process checks the flags, then starts the ranks."""
    from .arguments import parse_args
    from .errors import ArgumentError
    from .launch import torchrun_launch
    from .run_config import resolve

    prog = f"swift-mcore {cls.COMMAND}"
    try:
        launch = torchrun_launch()  # the layout first: a wrong one would wait forever
        config = resolve(parse_args(argv, prog=prog, cls=cls),
                         world_size=launch.world_size if launch else None)
        from .arguments.rlhf import check_score_head

        check_score_head(config)  # a score head trains only as a reward model
    except ArgumentError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        _no_restart_on_bad_flags(prog)
        return 2
    from .runtime import run_lock

    try:  # one run per --output_dir, before any work (docs/resume.md)
        lock = run_lock.acquire_for_cli(config.logging.output_dir, prog, launching=bool(launch),
                                        node_rank=launch.node_rank if launch else 0)
    except ArgumentError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    try:
        if launch:
            return launch.run([cls.COMMAND, *argv], lock)
        return _train(prog, config)
    finally:
        run_lock.release_all()


def _no_restart_on_bad_flags(prog: str) -> None:
    """A rank torchrun started with --max-restarts: bad flags stay bad on every attempt, so
    the job ends instead of restarting (runtime/elastic.py)."""
    if os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") not in ("", "0"):
        from .runtime import elastic

        elastic.stop_restarts(f"{prog}: the flags are refused (above)")


def _train(prog: str, config) -> int:
    from ._quiet import quiet_third_party
    from .errors import ArgumentError, CheckpointError, NonFiniteError, OutputError
    from .runtime import distributed

    quiet_third_party()
    try:
        trainer_class(config)(config).train()
    except (ArgumentError, CheckpointError, NonFiniteError, OutputError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    distributed.shutdown()
    return 0


def trainer_class(config):
    """The Trainer a command trains with: rlhf's own, else the base one."""
    if config.COMMAND == "rlhf" and config.rlhf.rlhf_type == "kto":
        from .training.kto_trainer import KtoTrainer

        return KtoTrainer
    if config.COMMAND == "rlhf" and config.rlhf.rlhf_type == "rm":
        from .training.reward_trainer import RewardTrainer

        return RewardTrainer
    if config.COMMAND == "rlhf" and config.rlhf.rlhf_type in ("orpo", "simpo"):
        from .training.reference_free_trainer import ReferenceFreeTrainer

        return ReferenceFreeTrainer
    if config.COMMAND == "rlhf":
        from .training.rlhf_trainer import DpoTrainer

        return DpoTrainer
    from .training.trainer import Trainer

    return Trainer


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
    "rlhf": (run_rlhf, "preference training: DPO on prompt/chosen/rejected pairs, KTO on "
                       "labelled answers, against a frozen reference, or a reward model "
                       "(docs/rlhf.md)"),
    "preprocess": (_lazy("swift_mcore.preprocess"),
                   "tokenize text files (jsonl, parquet, csv, txt, datasets) into .bin/.idx"),
    "export": (_lazy("swift_mcore.export"),
               "convert a checkpoint to a Hugging Face folder (--to_hf) or back (--to_mcore)"),
    "infer": (_lazy("swift_mcore.infer"),
              "generate text from a Hugging Face folder or a checkpoint"),
    "plot": (_lazy("swift_mcore.plot"),
             "draw a run's loss curves (train, validation, learning rate) into loss.png"),
}


def entry_point() -> None:
    """Console script: flush and leave without running interpreter teardown (commands shut
    their process groups down themselves; see runtime.distributed.exit_process).

    A command that crashes leaves the same way, after its traceback, with exit code 1 (130
    for Ctrl-C): teardown could otherwise turn the code into gloo's abort at exit.
    ``SystemExit`` (argparse's --help and usage errors) keeps Python's own handling.
    """
    try:
        code = main()
    except SystemExit:
        raise
    except BaseException as err:  # noqa: BLE001 - every crash gets its traceback, then the exit
        sys.excepthook(type(err), err, err.__traceback__)
        code = 130 if isinstance(err, KeyboardInterrupt) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
