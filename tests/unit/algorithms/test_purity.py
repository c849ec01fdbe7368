"""`megatron_rl.algorithms` stays pure: no torch.distributed, no other megatron_rl package,
no Megatron/vLLM (docs/design.md, rules). Checked on the sources' import graph (AST), since
`import torch` itself may load torch.distributed and a runtime check could not tell."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import megatron_rl.algorithms as algorithms

PACKAGE_DIR = Path(algorithms.__file__).parent
ALLOWED_ROOTS = {"__future__", "dataclasses", "math", "types", "typing", "collections", "torch"}


def _sources():
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    assert len(files) >= 5, files  # the scan must actually see the package
    return [(f, ast.parse(f.read_text(), filename=str(f))) for f in files]


def _imported_modules(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: inside the package by construction
                yield "megatron_rl.algorithms." + (node.module or "")
            else:
                for alias in node.names:
                    yield f"{node.module}.{alias.name}"  # catches `from torch import distributed`


def test_no_torch_distributed_import_or_attribute():
    offenders = []
    for path, tree in _sources():
        for name in _imported_modules(tree):
            if name == "torch.distributed" or name.startswith("torch.distributed."):
                offenders.append(f"{path.name}: import {name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "distributed":
                offenders.append(f"{path.name}:{node.lineno}: .distributed attribute")
    assert not offenders, offenders


def test_imports_stay_inside_the_allowed_graph():
    offenders = []
    for path, tree in _sources():
        for name in _imported_modules(tree):
            root = name.split(".")[0]
            inside = name.startswith("megatron_rl.algorithms")
            if not inside and root not in ALLOWED_ROOTS:
                offenders.append(f"{path.name}: {name}")
    assert not offenders, offenders


def test_checker_catches_a_violation():
    # the scan must flag the forms it is meant to catch (guards against a vacuous test)
    bad = ast.parse("import torch.distributed as dist\nfrom torch import distributed\n")
    names = list(_imported_modules(bad))
    assert "torch.distributed" in names and "torch.distributed" in names[1]


def test_importing_the_package_loads_nothing_else_of_the_project():
    # fresh interpreter: which project / heavy modules does the import pull in?
    code = (
        "import sys, megatron_rl.algorithms\n"
        "bad = [m for m in sys.modules if (m.startswith('megatron_rl.') and not\n"
        "       m.startswith('megatron_rl.algorithms')) or m.split('.')[0] in\n"
        "       ('megatron', 'vllm', 'transformers')]\n"
        "print(bad)\n"
    )
    repo_root = PACKAGE_DIR.parent.parent
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo_root)
    assert out.stdout.strip() == "[]", out.stdout
