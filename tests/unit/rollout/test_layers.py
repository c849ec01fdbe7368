"""rollout sits below the packages that use it: nothing in it imports them, at module level,
inside a function or under TYPE_CHECKING. The layers above keep what is theirs (multi-turn
episodes: environments.served and environments.replicas) and reach the rollout server
through its extension."""

import ast
from pathlib import Path

import megatron_rl

ROLLOUT = Path(megatron_rl.__file__).parent / "rollout"
ABOVE = ("rewards", "environments", "tasks", "from_config", "evaluation", "trainer", "cli")
"""The packages above rollout in the runtime's layers."""


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return names


def _package(name: str) -> str:
    """The runtime package a dotted name is in ("" for anything else)."""
    parts = name.split(".")
    return parts[1] if parts[0] == "megatron_rl" and len(parts) > 1 else ""


def test_rollout_imports_no_package_above_it():
    offenders = [
        f"{path.name} imports {name}"
        for path in sorted(ROLLOUT.glob("*.py"))
        for name in sorted(_imported(path))
        if _package(name) in ABOVE
    ]
    assert not offenders, offenders
