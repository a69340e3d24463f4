"""Layers import downward only, and no module imports itself through others (pure: parses source).

Every ``import`` / ``from ... import`` of every module under puzzle/ counts, wherever it stands
(module level, inside a function, under ``if TYPE_CHECKING``): a function-local import does not
hide an arrow. The layers, from the bottom:

    0  config, config_flags, config_checks, plan_layouts, parallel, fail_fast, model_shape, model_arch,
       checkpoint_errors, lora_config, memory_levers
       (flags' values, process layouts, bad input, the one model-shape type)
    1  models                                             (GPTModel builders, parameter layout/names)
    2  engine, rollout, pipeline, switch, algorithms, data  (model engines, generation, schedules, math)
    3  dataflow, checkpointing, checkpoint_metadata, rng_state, save_failures, reward_functions, metrics, run_control, weight_sources
       (dataflow: the trainer, the five stages, the rollout batch, micro-batching, evaluation)
    4  cli, arguments, role_arch, flag_checks, tools, bench, plan_search  (command line and tools)

A module may import its own layer or any layer below. Below the command line (layers 0-3) nothing
reads the environment but the launcher's contract (``ENV_READERS``: torchrun's RANK, WORLD_SIZE,
LOCAL_RANK), and nothing imports argparse but the flag definitions (``ARGPARSE_USERS``).
``plan_search/`` (the plan search) is in the top layer because its commands read the command line,
but its cost model, memory model and search are pure: they import only config, model_shape,
parallel and plan_search itself, and nothing in plan_search/ reaches models, training, rollout,
pipeline, switch or torch.distributed. ``algorithms/`` holds pure functions and frozen records only.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "puzzle"

LAYERS = [
    {"config", "config_flags", "config_checks", "plan_layouts", "parallel", "fail_fast", "model_shape", "model_arch",
     "checkpoint_errors", "lora_config", "memory_levers"},
    {"models"},
    {"engine", "rollout", "pipeline", "switch", "algorithms", "data"},
    {"dataflow", "checkpointing", "checkpoint_metadata", "rng_state", "save_failures", "reward_functions", "metrics", "run_control", "weight_sources"},
    {"cli", "arguments", "role_arch", "flag_checks", "tools", "bench", "plan_search"},
]
LAYER_OF = {part: i for i, parts in enumerate(LAYERS) for part in parts}

#: below the command line, the only module that reads os.environ: torchrun's contract
ENV_READERS = {"puzzle.parallel.launcher"}
#: below the command line, the only module that imports argparse: it turns config fields into flags
ARGPARSE_USERS = {"puzzle.config_flags"}

PLAN_FORBIDDEN = ("puzzle.models", "puzzle.engine", "puzzle.dataflow", "puzzle.rollout", "puzzle.pipeline",
                  "puzzle.switch", "torch.distributed")
PLAN_PURE_CORE = ("puzzle.plan_search.cost_model", "puzzle.plan_search.memory_model", "puzzle.plan_search.search",
                  "puzzle.plan_search.profile_data", "puzzle.plan_search.bundled_profile")
PLAN_PURE_ALLOWED = ("puzzle.config", "puzzle.model_shape", "puzzle.parallel", "puzzle.plan_search")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str, is_package: bool, known: Set[str]) -> List[Tuple[str, int]]:
    """(imported module, line) for every import statement in ``source``; ``from pkg import name``
    names the submodule pkg.name when that is a module of ``known``."""
    out = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append((sub if sub in known else target, node.lineno))
    return out


def environment_reads(source: str) -> List[int]:
    """Lines that read or write the process environment or the command line: ``os.environ``,
    ``os.getenv``, ``os.putenv``, ``os.unsetenv``, ``sys.argv``, or ``environ`` / ``getenv``
    imported from os."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and (
                node.value.id == "os" and node.attr in ("environ", "environb", "getenv", "putenv", "unsetenv")
                or node.value.id == "sys" and node.attr == "argv"):
            out.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "environb", "getenv", "putenv", "unsetenv") for a in node.names):
            out.append(node.lineno)
    return sorted(out)


PATHS = {module_name(p): p for p in PKG.rglob("*.py")}


def _graph() -> Dict[str, List[Tuple[str, int]]]:
    known = set(PATHS)
    return {m: imports_of(p.read_text(), m, p.name == "__init__.py", known) for m, p in sorted(PATHS.items())}


GRAPH = _graph()


def _internal(target: str) -> str:
    """The puzzle module ``target`` names (a module of the graph, or the nearest package), or ''."""
    while target and target not in GRAPH:
        target = target.rpartition(".")[0]
    return target


def layer(module: str) -> int:
    """The layer of a puzzle module; a module without one counts as above every layer."""
    return LAYER_OF.get(module.split(".")[1], len(LAYERS))


def find_cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (or a module importing itself)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):  # Tarjan, recursive: the graph is a few hundred edges
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_parser_sees_function_local_and_relative_imports():
    src = "import os\nfrom . import b\ndef f():\n    from puzzle.models import init\n    import torch.distributed\n"
    got = imports_of(src, "puzzle.switch.a", False, {"puzzle.switch.b", "puzzle.models.init"})
    assert got == [("os", 1), ("puzzle.switch.b", 2), ("puzzle.models.init", 4), ("torch.distributed", 5)]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_environment_reads_are_found():
    src = "import os\nfrom os import environ\nx = os.environ.get('A')\ny = os.getenv('B')\nz = os.path.join('c')\n" \
          "a = sys.argv[1:]\nb = sys.path\n"
    assert environment_reads(src) == [2, 3, 4, 6]


def test_below_the_command_line_nothing_reads_the_environment():
    """Flags reach the code through RunConfig; only the launcher's contract reads os.environ, and
    nothing reads sys.argv."""
    bad = [f"{m}:{line}" for m, p in sorted(PATHS.items()) if m != "puzzle" and layer(m) < len(LAYERS) - 1
           and m not in ENV_READERS for line in environment_reads(p.read_text())]
    assert not bad, "reads os.environ or sys.argv below the command-line layer: " + ", ".join(bad)
    assert all(m in GRAPH and environment_reads(PATHS[m].read_text()) for m in ENV_READERS)


def test_below_the_command_line_nothing_imports_argparse():
    bad = [f"{m}:{line}" for m, targets in GRAPH.items() if m != "puzzle" and layer(m) < len(LAYERS) - 1
           and m not in ARGPARSE_USERS for target, line in targets if target == "argparse"]
    assert not bad, "imports argparse below the command-line layer: " + ", ".join(bad)


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in GRAPH if m != "puzzle" and m.split(".")[1] not in LAYER_OF)
    assert not unplaced, f"modules without a layer (add them to LAYERS): {unplaced}"


def test_no_import_cycles():
    graph = {m: {t for t in map(_internal, (t for t, _ in targets)) if t and t != m}
             for m, targets in GRAPH.items()}
    assert find_cycles(graph) == []


@pytest.mark.parametrize("low", range(len(LAYERS) - 1))
def test_layers_import_downward_only(low):
    upward = []
    for m, targets in GRAPH.items():
        if m == "puzzle" or layer(m) != low:
            continue
        for target, line in targets:
            t = _internal(target)
            if t and t != "puzzle" and layer(t) > low:
                upward.append(f"{m}:{line} imports {t} (layer {layer(t)} > {low})")
    assert not upward, "\n".join(upward)


def test_plan_is_pure():
    bad = []
    for m, targets in GRAPH.items():
        if not m.startswith("puzzle.plan_search"):
            continue
        for target, line in targets:
            if any(target == f or target.startswith(f + ".") for f in PLAN_FORBIDDEN):
                bad.append(f"{m}:{line} imports {target}")
            if m in PLAN_PURE_CORE and target.startswith("puzzle") and not any(
                    target == a or target.startswith(a + ".") for a in PLAN_PURE_ALLOWED):
                bad.append(f"{m}:{line} (pure core) imports {target}")
    assert all(m in GRAPH for m in PLAN_PURE_CORE)
    assert not bad, "\n".join(bad)


# ---- the trainer owns its run: nothing outside its module reaches into it ---------------------
#: the module of PPOTrainer, and what others may call on a trainer (build it, run it, close it)
TRAINER_MODULE = "puzzle.dataflow.trainer"
TRAINER_INTERFACE = {"for_run", "train", "close"}


def trainer_reads(source: str) -> List[Tuple[int, str]]:
    """(line, attribute) of every attribute read or written on a trainer outside its interface:
    ``x.attr`` and ``getattr(x, "attr")`` / ``setattr(x, "attr", ...)`` where ``x`` is a name
    that says it is a trainer (``trainer``, ``ppo_trainer``, ...) or was bound to ``PPOTrainer(...)``
    / ``PPOTrainer.for_run(...)``."""
    tree = ast.parse(source)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            called = func.attr if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
                and func.value.id == "PPOTrainer" else getattr(func, "id", None)
            if called in ("PPOTrainer", "for_run"):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))

    def is_trainer(node) -> bool:
        return isinstance(node, ast.Name) and (node.id in names or "trainer" in node.id.lower())

    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_trainer(node.value) and node.attr not in TRAINER_INTERFACE:
            out.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "setattr", "hasattr")
              and len(node.args) >= 2 and is_trainer(node.args[0]) and isinstance(node.args[1], ast.Constant)
              and node.args[1].value not in TRAINER_INTERFACE):
            out.append((node.lineno, node.args[1].value))
    return sorted(out)


def test_nothing_outside_the_trainer_reads_its_attributes():
    """The trainer owns its run (loop, loader, checkpointer, evaluator, loggers): the CLI builds it,
    calls train() and close(); no other puzzle module reads or replaces a trainer attribute."""
    found = {m: trainer_reads(PATHS[m].read_text()) for m in sorted(PATHS) if m != TRAINER_MODULE}
    found = {m: hits for m, hits in found.items() if hits}
    assert not found, f"modules reaching into the trainer: {found}"


def test_trainer_reads_finds_a_planted_read():
    """Negative control: each way of reaching into a trainer is found."""
    planted = ("def f(trainer, cfg):\n"
               "    trainer.train()\n"
               "    x = trainer.engines['actor']\n"
               "    trainer.on_iteration_end = print\n"
               "    getattr(trainer, 'generation_progress', None)\n"
               "    t = PPOTrainer.for_run(cfg)\n"
               "    return t.iteration\n")
    assert trainer_reads(planted) == [(3, "engines"), (4, "on_iteration_end"), (5, "generation_progress"),
                                      (7, "iteration")]
    assert trainer_reads("def f(trainer):\n    trainer.train()\n    trainer.close()\n") == []


def stateful_classes(source: str) -> List[str]:
    """Classes of ``source`` that are not frozen dataclasses (objects that hold state)."""
    def frozen(dec) -> bool:
        return isinstance(dec, ast.Call) and getattr(dec.func, "id", None) == "dataclass" and any(
            k.arg == "frozen" and getattr(k.value, "value", False) is True for k in dec.keywords)

    return [node.name for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ClassDef) and not any(frozen(d) for d in node.decorator_list)]


def test_algorithms_hold_no_state():
    """algorithms/ is pure functions (and frozen records); stateful controllers live with the stage
    that owns them in dataflow/ (the KL controller, the running score moments)."""
    found = {m: stateful_classes(p.read_text()) for m, p in sorted(PATHS.items()) if m.startswith("puzzle.algorithms")}
    assert not {m: c for m, c in found.items() if c}, found
    planted = "@dataclass(frozen=True)\nclass A:\n    x: int\n\n@dataclass\nclass B:\n    y: int\n\nclass C:\n    pass\n"
    assert stateful_classes(planted) == ["B", "C"]
