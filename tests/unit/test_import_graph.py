"""The runtime's import graph: packages in layers with one direction, no cycles, and nothing
of the lab or the test helpers in it.

`megatron_rl` is what a training job imports; `megatron_rl_lab` (benchmarks, trace
simulators, test helpers) studies it and may import it, never the reverse. The runtime's
packages form the layers of :data:`LAYERS` (docs/design.md, "Layers"): a package imports
only packages of strictly lower layers. Every rule is read from the sources with `ast`,
every import counted (those inside functions and under TYPE_CHECKING too), so a lazy
import cannot hide an edge: a typing-only need is met by moving the type down.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNTIME = "megatron_rl"
LAB = "megatron_rl_lab"  # megatron_rl_lab.testing, the test helpers, included

LAYERS = (
    ("platform", "utils", "commands"),
    ("launch",),
    ("algorithms", "data", "monitor", "parallel"),
    ("checkpoint",),
    ("models",),
    ("config",),
    ("bridge", "schedules"),
    ("rollout",),
    ("rewards",),
    ("environments",),
    ("tasks",),
    ("from_config",),
    ("evaluation",),
    ("trainer",),
    ("cli",),
    ("__main__",),
)
"""The runtime's packages (and top-level modules) from the bottom up; the same list as
docs/design.md's. ``commands`` names the subcommands' modules as strings, as entry points
do: the CLI imports them."""


def _modules(package: str) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package)."""
    found = {}
    for path in sorted((REPO / package).rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _imported(name: str, path: Path, is_package: bool, top_level_only: bool, modules=()) -> set[str]:
    """The dotted names a module imports. `from pkg import sub` counts as `pkg.sub` when
    that is one of `modules`, else as `pkg` (a name defined in pkg)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    here = name.split(".") if is_package else name.split(".")[:-1]
    nodes = tree.body if top_level_only else ast.walk(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                names.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return names


def _graph(modules: dict, top_level_only: bool) -> dict[str, set[str]]:
    return {
        name: _imported(name, path, is_package, top_level_only, modules) & modules.keys()
        for name, (path, is_package) in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(root):
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_runtime_imports_neither_the_lab_nor_the_test_helpers():
    offenders = []
    for name, (path, is_package) in _modules(RUNTIME).items():
        for imported in _imported(name, path, is_package, top_level_only=False):
            if imported == LAB or imported.startswith(LAB + "."):
                offenders.append(f"{name} imports {imported}")
    assert not offenders, offenders


def _unit(module: str) -> str:
    """The package (or top-level module) of the runtime that ``module`` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer_of() -> dict[str, int]:
    return {unit: layer for layer, units in enumerate(LAYERS) for unit in units}


def test_every_runtime_package_has_a_layer():
    units = {_unit(name) for name in _modules(RUNTIME)} - {""}  # "": megatron_rl/__init__.py, imports nothing
    layer_of = _layer_of()
    assert sum(len(units) for units in LAYERS) == len(layer_of), "a package is named in two layers"
    assert units == set(layer_of), f"unplaced: {sorted(units - set(layer_of))}, gone: {sorted(set(layer_of) - units)}"


def test_every_import_points_down_the_layers():
    """Counting every import, lazy or not: an arrow within a package or to a lower layer only."""
    modules = _modules(RUNTIME)
    layer_of = _layer_of()
    against = []
    for name, (path, is_package) in modules.items():
        for imported in sorted(_imported(name, path, is_package, top_level_only=False, modules=modules)):
            if imported not in modules and imported != RUNTIME:
                continue
            source, target = _unit(name), _unit(imported)
            if source == target:
                continue
            if target == "" or layer_of[target] >= layer_of[source]:
                against.append(f"{name} imports {imported} ({source} is not above {target or RUNTIME})")
    assert not against, "\n".join(against)


def test_the_layer_check_sees_lazy_and_typing_only_imports(tmp_path):
    """The checker itself: an import inside a function and one under TYPE_CHECKING both count."""
    module = tmp_path / "probe.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from megatron_rl.trainer import state\n"
        "def f():\n    from megatron_rl.cli import main\n"
    )
    found = _imported("megatron_rl.platform.probe", module, False, top_level_only=False)
    assert {"megatron_rl.trainer", "megatron_rl.cli"} <= found


def test_no_import_cycles_at_module_level():
    """Imports inside functions may point back up (they run after both modules loaded);
    module-level imports form a DAG, so any runtime module imports on its own."""
    modules = _modules(RUNTIME)
    modules.update(_modules("megatron_rl_lab"))
    assert _cycles(_graph(modules, top_level_only=True)) == []


def test_the_lab_reaches_the_command_line_through_entry_points():
    """`megatron-rl bench` is the lab's, found through the installed entry points, and an
    entry point cannot take over a runtime command."""
    from megatron_rl.commands import RUNTIME, installed

    commands = installed()
    assert commands["bench"].module == "megatron_rl_lab.bench.cli"
    assert {name: commands[name] for name in RUNTIME} == RUNTIME
    assert "bench" not in installed("monitor")
