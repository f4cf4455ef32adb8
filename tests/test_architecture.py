"""The shape of the package: its import graph has no cycle, the arguments and the runtime are
the ground floor, and a run's resolved configuration is immutable and resolved the same way
every time."""

import ast
import copy
import dataclasses
import signal
from pathlib import Path
from typing import Dict, Set

import pytest

from swift_mcore import RunArguments, SftArguments
from swift_mcore.run_config import RunConfig, resolve

PACKAGE = Path(__file__).resolve().parents[1] / "swift_mcore"
# Layers that import nothing of swift-mcore above them (besides the leaf errors module).
GROUND_FLOOR = ("arguments", "runtime")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> Dict[str, Set[str]]:
    """module -> the swift_mcore modules it imports anywhere (module level or inside a
    function: a lazy import is still a dependency)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: Dict[str, Set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    as_module = f"{target}.{alias.name}"
                    found.add(as_module if as_module in modules else target)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def cycles(graph: Dict[str, Set[str]]):
    """Strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack, on_stack, found = [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_lazy_imports():
    graph = import_graph()
    # run_config imports the family registry inside resolve(); the test must see it.
    assert "swift_mcore.models.families" in graph["swift_mcore.run_config"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def folder_graph(graph: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    """The module graph seen from the package's top level: ``swift_mcore.X`` (a folder or a
    module) -> the other top-level parts it imports from anywhere inside it."""
    def top(module: str) -> str:
        return module.split(".")[1] if "." in module else module

    folders: Dict[str, Set[str]] = {}
    for module, deps in graph.items():
        folders.setdefault(top(module), set()).update(top(d) for d in deps)
    return {folder: deps - {folder} for folder, deps in folders.items()}


def test_no_import_cycle_between_folders():
    """Module cycles are not the only knot: models.a -> checkpointing.b and
    checkpointing.c -> models.d tie two folders together with no module cycle. The layers of
    docs/architecture.md hold only if the folders' graph has none either."""
    assert folder_graph({"p.a.x": {"p.b.y"}, "p.b.z": {"p.a.w"}, "p.a.w": set(),
                         "p.b.y": set()}) == {"a": {"b"}, "b": {"a"}}
    assert cycles(folder_graph(import_graph())) == []


@pytest.mark.parametrize("layer", GROUND_FLOOR)
def test_ground_floor_imports_nothing_above_it(layer):
    upward = {m: sorted(d for d in deps if d.split(".")[1] not in (layer, "errors"))
              for m, deps in import_graph().items() if m.split(".")[1:2] == [layer]}
    assert {m: d for m, d in upward.items() if d} == {}


def test_every_module_says_its_concern_first():
    for path in PACKAGE.rglob("*.py"):
        first = path.read_text().splitlines()[0]
        assert first.startswith('"""') and len(first) > 12, path


FLAGS = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
             seq_length=32, micro_batch_size=2, global_batch_size=8, train_iters=2,
             lr_warmup_iters=0, eval_steps=0, log_interval=1, tensorboard=False,
             progress_bar=False, num_workers=0, no_save=True)


def test_resolving_twice_gives_equal_configs_and_leaves_the_arguments():
    args = RunArguments.from_flags(**FLAGS)
    before = copy.deepcopy(args)
    first, second = resolve(args, world_size=2), resolve(args, world_size=2)
    assert first == second and isinstance(first, RunConfig)
    assert args == before and args.model.ffn_hidden_size is None  # filled in the copy only
    assert first.model.ffn_hidden_size == 192 and first.world.data_parallel == 2
    assert first.world.num_microbatches == 2


def test_a_resolved_config_cannot_be_changed(tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text('{"query": "hi", "response": "hello"}\n')
    config = resolve(SftArguments.from_flags(dataset=[str(data)]), world_size=1)
    for group, name, value in (("model", "hidden_size", 8), ("training", "lr", 1.0),
                               ("data", "data_path", ["x"]), ("checkpoint", "resume", "auto")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(getattr(config, group), name, value)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.world = None
    with pytest.raises(AttributeError):  # lists are frozen into tuples
        config.data.dataset.append("x")
    assert [s.path for s in config.dataset_sources] == [str(data)]


def test_completing_with_epochs_resolves_train_iters_once():
    args = RunArguments.from_flags(num_train_epochs=2.5, lr_warmup_iters=0)
    plan = resolve(args, world_size=1)
    done = plan.complete(4000, 100)
    assert done.training.train_iters == 16  # ceil(2.5 * 100 / 16)
    assert done.padded_vocab_size == 4096 and done.vocab_size == 4000
    assert plan.padded_vocab_size is None and args.training.train_iters == 300


def test_the_attention_is_decided_once():
    # auto is the fastest exact path: torch's SDPA without CUDA, TE's with CUDA and TE,
    # megatron's local module on CUDA without TE.
    cpu = resolve(RunArguments(), world_size=1, cuda=False)
    assert (cpu.attention, cpu.layer_spec, cpu.packed_rows) == ("sdpa", "local",
                                                                "block_causal_mask")
    assert "scaled_dot_product_attention" in cpu.describe()
    no_te = resolve(RunArguments(), world_size=1, cuda=True, transformer_engine=False)
    assert (no_te.attention, no_te.layer_spec) == ("local", "local")
    local = resolve(RunArguments.from_flags(attention_backend="local"), world_size=1,
                    cuda=False)
    assert local.attention == "local" and "DotProductAttention" in local.describe()
    te = resolve(RunArguments(), world_size=1, cuda=True, transformer_engine=True)
    assert (te.attention, te.layer_spec, te.packed_rows) == (
        "transformer_engine", "transformer_engine", "thd")
    chosen = resolve(RunArguments.from_flags(attention_backend="sdpa"), world_size=1,
                     cuda=True, transformer_engine=True)
    assert (chosen.attention, chosen.layer_spec) == ("sdpa", "local")  # the flag is obeyed
    assert "Transformer Engine" in te.describe() and "scaled_dot_product" in chosen.describe()


def test_training_leaves_the_arguments_as_they_were(gloo_group, tmp_path):
    from swift_mcore.training.trainer import Trainer

    args = RunArguments.from_flags(**FLAGS, output_dir=str(tmp_path / "run"))
    before = copy.deepcopy(args)
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        trainer = Trainer(args)
        state = trainer.train()
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    assert state.iteration == 2
    assert args == before and trainer.args is args
    assert trainer.config.padded_vocab_size == 4096


def test_a_one_process_group_leaves_the_environment_as_it_was():
    """`Trainer(args).train()` in a script, then `subprocess.run(["swift-mcore", ...])`: the
    child must not inherit RANK or MASTER_PORT from the script's one-rank group."""
    import json
    import os
    import subprocess
    import sys

    code = (
        "import json, os, sys\n"
        "before = dict(os.environ)\n"
        "from swift_mcore import RunArguments\n"
        "from swift_mcore.run_config import resolve\n"
        "from swift_mcore.runtime import distributed\n"
        "import torch.distributed as dist\n"
        "distributed.initialize(resolve(RunArguments(), world_size=1))\n"
        "assert dist.get_world_size() == 1\n"
        "print(json.dumps(sorted(set(os.environ.items()) ^ set(before.items()))))\n"
        "sys.stdout.flush(); os._exit(0)\n")
    launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launch}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=240, cwd=PACKAGE.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


# ---- CUDA is decided once, and the CPU port has one face -------------------------------------
HARDWARE = "swift_mcore.runtime.hardware"
CPU_WING = "swift_mcore.runtime.cpu"


def cuda_probes(source: str):
    """Line numbers where ``source`` calls ``<anything>.cuda.is_available()``."""
    def dotted(node) -> str:
        if isinstance(node, ast.Attribute):
            return f"{dotted(node.value)}.{node.attr}"
        return node.id if isinstance(node, ast.Name) else "?"

    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and dotted(node.func).endswith("cuda.is_available")]


def test_only_the_hardware_module_asks_torch_for_cuda():
    """RunConfig.cuda is decided once (run_config.resolve, from runtime/hardware.py); every
    other module reads it, so resolve(cuda=True) simulates a GPU for all of them."""
    assert cuda_probes("import torch\nif torch.cuda.is_available():\n    pass\n") == [2]
    probes = {module_name(p): cuda_probes(p.read_text()) for p in PACKAGE.rglob("*.py")}
    assert {m for m, lines in probes.items() if lines} == {HARDWARE}


def test_the_cpu_port_is_reached_only_through_its_face():
    """Nothing outside runtime/cpu/ imports its inner modules: the general code calls the
    functions of runtime/cpu/__init__.py, each a no-op on CUDA."""
    graph = import_graph()
    inner = {m for m in graph if m.startswith(CPU_WING + ".")}
    assert {"swift_mcore.runtime.cpu.cpu_compat", "swift_mcore.runtime.cpu.onednn_linear"} <= inner
    reaching_in = {m: sorted(deps & inner) for m, deps in graph.items()
                   if m != CPU_WING and not m.startswith(CPU_WING + ".") and deps & inner}
    assert reaching_in == {}
    assert CPU_WING in graph["swift_mcore.runtime.distributed"]  # the face is what they use


def test_the_cpu_port_stands_on_the_ground_floor():
    """The port adapts megatron-core and torch: of swift-mcore it uses only the runtime
    around it and errors, never models, training, checkpointing or data."""
    graph = import_graph()
    outside = {m: sorted(d for d in deps if not d.startswith("swift_mcore.runtime")
                         and d != "swift_mcore.errors")
               for m, deps in graph.items() if m == CPU_WING or m.startswith(CPU_WING + ".")}
    assert {m: d for m, d in outside.items() if d} == {}
