"""flame's layers: each folder of flame/ imports only the folders below it (docs/development.md, "Layers").

Every import counts: at the top of a module, inside functions, under ``if __name__ == "__main__"``,
and ``importlib.import_module("flame....")`` with a literal name. An import inside a function is
allowed only where it is listed in FUNCTION_LEVEL with the reason it cannot sit at the top.
"""

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

FLAME = Path(__file__).resolve().parent.parent / "flame"
# data shipped inside the package, not code of a layer: the job files and model configs (the checkout's
# top-level configs/ links there), whose eval example holds a dataset script lm-eval loads
DATA_FOLDERS = {"configs"}

# Lowest first. A layer imports the layers before it and itself; ``launch`` and ``eval`` share a rank and
# import neither each other. The entry points sit on top: ``flame.train`` (the ranks' program, above the
# training loop it runs and below train.sh's launcher, which forks ranks into it), then ``flame`` itself
# (``flame.register``) and flame/utils/ (the converters' documented command names).
LAYERS = ("base", "compat", "config", "data", "models", "distributed", "optim", "checkpoint", "memory", "prepare",
          "training", "train", "tools", ("launch", "eval"), "entry")
RANK = {name: rank for rank, layer in enumerate(LAYERS) for name in (layer if isinstance(layer, tuple) else (layer,))}

# Imports that wait inside a function: the importing module, the module it imports, and why it waits.
# train.sh's launcher imports in stages, so that the job's check forks before the trainer's imports and
# the ranks fork after them (flame.launch.supervise's docstring).
FUNCTION_LEVEL_TABLE = """
flame                               flame.models.registry                      importing flame must stay light: every flame process imports the package first
flame.train                         flame.prepare                              after parsing: `-h` and parsing errors answer before the planner and models import
flame.train                         flame.training.trainer                     after parsing: `-h` and config errors answer before torchtitan's trainer imports
flame.checkpoint.export             flame.models.builder                       the HF export imports no torchtitan (the builder does) unless the run's weights need re-initializing
flame.compat                        flame.base.device                          device imports torchtitan, which loading an export (flame.register) does not need
flame.compat                        flame.compat.fla                           each seam imports its library (seconds); a process imports the seams it uses
flame.compat                        flame.compat.fla_mamba                     each seam imports its library (seconds)
flame.compat                        flame.compat.mamba_ssm                     each seam imports its library (seconds)
flame.compat                        flame.compat.torchtitan                    each seam imports its library (seconds)
flame.compat                        flame.compat.triton                        each seam imports its library (seconds)
flame.models.inputs                 flame.models.loss                          the loss head imports torchtitan, which loading an export does not need
flame.models.kernels.selective_scan flame.models.kernels.selective_scan_triton the Triton kernels compile on a GPU only; a CPU scan never imports them
flame.memory                        flame.memory.hardware                      `python -m flame.memory.hardware` runs it, which a module imported with the package would warn about
flame.memory.activations            flame.memory.probe                         the probe builds on this module's hooks: imported at the top, the two would import each other
flame.eval.__main__                 flame.base.device                          after lm-eval's arguments parse: `-h` answers before torch imports
flame.eval.__main__                 flame.eval.model                           after lm-eval's arguments parse: `-h` answers before lm-eval imports
flame.eval.__main__                 flame.eval.report                          after lm-eval's arguments parse
flame.eval.__main__                 flame.eval.tasks                           after lm-eval's arguments parse
flame.eval.__main__                 flame.models.registry                      after lm-eval's arguments parse
flame.launch.supervise              flame.base.autotune                        the launcher's first stage: what parsing needs
flame.launch.supervise              flame.compat.transformers                  the launcher's first stage, before transformers' models load
flame.launch.supervise              flame.config.manager                       the launcher's first stage: what parsing needs
flame.launch.supervise              flame.launch.preflight                     in the forked check only: its imports stay out of the ranks' parent
flame.launch.supervise              flame.compat.triton                        in the forked check only, on GPUs: its compile watch imports torch and Triton
flame.launch.supervise              flame.train                                the second stage: what every rank imports, while the check runs
flame.launch.supervise              flame.training.trainer                     the second stage: what every rank imports, while the check runs
flame.launch.supervise              flame.tools.plot                           after training: matplotlib only for the curves
flame.launch.supervise              flame.base.run_record                      after training, with the curves
flame.launch.supervise              flame.checkpoint.export                    after training: the HF export
flame.launch.supervise              flame.compat.torchrun                      with torchrun's agent, in the second stage
flame.__main__                      flame.compat.transformers                  for the subcommands that load models only: `flame -h` stays instant
"""
FUNCTION_LEVEL = {tuple(line.split(maxsplit=2)[:2]): line.split(maxsplit=2)[2]
                  for line in FUNCTION_LEVEL_TABLE.strip().splitlines()}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the flame module imported
    line: int
    in_function: bool


def modules() -> dict[str, Path]:
    found = {}
    for path in FLAME.rglob("*.py"):
        parts = list(path.relative_to(FLAME.parent).with_suffix("").parts)
        if parts[1] in DATA_FOLDERS:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def layer(module: str) -> str:
    parts = module.split(".")
    if module == "flame.train":
        return "train"
    if len(parts) == 1 or parts[1] == "utils" or (len(parts) == 2 and not (FLAME / parts[1]).is_dir()):
        return "entry"
    return parts[1]


def imports_of(module: str, source: str, known: dict[str, Path], package: bool = False) -> list[Import]:
    """Every flame module ``source`` (the text of ``module``) imports, with where."""
    tree = ast.parse(source)
    package_name = module if package else module.rpartition(".")[0]

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package_name.split(".")[: len(package_name.split(".")) - (child.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                submodules = [f"{base}.{alias.name}" for alias in child.names if f"{base}.{alias.name}" in known]
                names = submodules if len(submodules) == len(child.names) else [base, *submodules]
            elif (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                  and child.func.attr == "import_module" and child.args and isinstance(child.args[0], ast.Constant)):
                names = [child.args[0].value]
            for name in names:
                target = resolve(name) if isinstance(name, str) and name.startswith("flame") else None
                if target and target != module:
                    found.append(Import(module, target, child.lineno, inside))
            visit(child, inside)

    visit(tree, False)
    return found


def all_imports() -> list[Import]:
    known = modules()
    return [found for module, path in known.items()
            for found in imports_of(module, path.read_text(), known, package=path.name == "__init__.py")]


def upward(found: Import) -> bool:
    """Whether an import points to a layer above its own, or across to another layer of the same rank."""
    mine, theirs = layer(found.module), layer(found.target)
    if found.target == "flame":  # the package itself: its __init__ imports nothing at the top
        return False
    return RANK[theirs] > RANK[mine] or (RANK[theirs] == RANK[mine] and theirs != mine)


def test_every_folder_of_flame_is_a_layer():
    folders = {path.name for path in FLAME.iterdir() if path.is_dir() and not path.name.startswith("__")} - DATA_FOLDERS
    assert folders - {"utils"} <= set(RANK), f"folders without a layer: {sorted(folders - set(RANK) - {'utils'})}"
    loose = {path.stem for path in FLAME.glob("*.py")} - {"__init__", "__main__", "train"}
    assert not loose, f"only entry points sit at the top of flame/: move {sorted(loose)} into a layer"


def test_no_import_points_up():
    wrong = [f"{f.module}:{f.line} imports {f.target} ({layer(f.module)} -> {layer(f.target)})"
             for f in all_imports() if upward(f)]
    assert not wrong, "imports that point up a layer:\n" + "\n".join(wrong)


def test_an_upward_import_is_caught():
    """The check itself: a planted import of the trainer into the ground floor is reported, a downward one is not."""
    known = modules()
    planted = "def f():\n    from flame.training.trainer import Trainer\n"
    assert [upward(f) for f in imports_of("flame.base.device", planted, known)] == [True]
    assert [upward(f) for f in imports_of("flame.training.trainer", "from flame.base import device\n", known)] == [False]
    by_name = "import importlib\nimportlib.import_module('flame.launch.supervise')\n"
    assert [upward(f) for f in imports_of("flame.data.loader", by_name, known)] == [True]


def test_function_level_imports_are_the_listed_ones():
    found = {(f.module, f.target) for f in all_imports() if f.in_function}
    unlisted = sorted(found - set(FUNCTION_LEVEL))
    stale = sorted(set(FUNCTION_LEVEL) - found)
    assert not unlisted, f"imports inside functions without a reason in FUNCTION_LEVEL (move them to the top): {unlisted}"
    assert not stale, f"FUNCTION_LEVEL lists imports that are gone: {stale}"


def test_the_layers_import_each_other_without_a_cycle():
    edges: dict[str, set[str]] = {}
    for f in all_imports():
        mine, theirs = layer(f.module), layer(f.target)
        if f.target != "flame" and mine != theirs:
            edges.setdefault(mine, set()).add(theirs)
    done: set[str] = set()

    def walk(node: str, path: tuple[str, ...]) -> None:
        if node in path:
            pytest.fail(f"the layers import each other in a cycle: {' -> '.join(path[path.index(node):] + (node,))}")
        if node in done:
            return
        for nxt in edges.get(node, ()):
            walk(nxt, path + (node,))
        done.add(node)

    for start in list(edges):
        walk(start, ())


def test_no_module_of_flame_is_over_400_lines():
    long = {str(path.relative_to(FLAME.parent)): n for path in FLAME.rglob("*.py")
            if path.relative_to(FLAME).parts[0] not in DATA_FOLDERS and (n := len(path.read_text().splitlines())) > 400}
    assert not long, f"split these modules, each holds two things: {long}"
