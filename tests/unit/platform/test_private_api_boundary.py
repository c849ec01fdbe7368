"""No dependency's private API is used outside ``megatron_rl/platform/``.

The runtime reaches into vLLM, Megatron-Core, torch and CPython only through the
platform layer's patches and accessors, each stating the release it was written for, so an
upgrade of a dependency means reading ``platform/`` and running its tests. The check is an
AST walk of the runtime package ``megatron_rl`` outside ``platform/`` that flags:

* ``obj._name`` where ``obj`` is not ``self``/``cls``, one of our own modules, or a class or
  function the file defines;
* ``getattr``/``setattr``/``hasattr``/``delattr`` with a literal ``"_name"`` on anything
  but ``self``/``cls``;
* ``from dependency import _name`` and imports of a dependency's ``_module``;
* assignments to ``__class__``;
* string literals naming another module's private global (``"_CUDA_RNG_STATE_TRACKER"``),
  read or swapped through ``getattr``/``setattr`` with a variable name;
* class-name checks (``type(x).__name__ == "SomeClass"``) in place of ``isinstance``.
"""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "megatron_rl"
NOT_RUNTIME = ("platform",)
"""The one place allowed to reach into a dependency (the lab, megatron_rl_lab, is not runtime)."""
OWN = "megatron_rl"

ALLOWED = {("os", "_exit")}
"""Public API despite the underscore: ``os._exit`` is documented (leave without cleanup)."""


PRIVATE_GLOBAL = re.compile(r"^_[A-Z][A-Z0-9_]+$")
"""A private module-level constant's name: ours are referenced by name, never as a string."""


def _is_class_name(node: ast.AST) -> bool:
    """``type(x).__name__`` or ``x.__class__.__name__``."""
    if not (isinstance(node, ast.Attribute) and node.attr == "__name__"):
        return False
    base = node.value
    is_type_call = isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "type"
    return is_type_call or (isinstance(base, ast.Attribute) and base.attr == "__class__")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_names(tree: ast.Module) -> set[str]:
    """Names a file binds to our own code: its own classes and functions, and what it imports
    from megatron_rl (``from megatron_rl.x import y``, ``import megatron_rl``)."""
    own = {"self", "cls"}
    own.update(n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == OWN:
            own.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            own.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == OWN)
    return own


def violations(source: str) -> list[str]:
    """Every use of a dependency's private API in ``source``, as ``line: what``."""
    tree = ast.parse(source)
    own = _own_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = node.value
            if node.attr == "__class__" and isinstance(node.ctx, ast.Store):
                found.append(f"{node.lineno}: {ast.unparse(node)} = ...")
            elif _private(node.attr) and not (isinstance(base, ast.Name) and base.id in own):
                if (ast.unparse(base), node.attr) not in ALLOWED:
                    found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and PRIVATE_GLOBAL.match(node.value):
            found.append(f"{node.lineno}: the string {node.value!r}")
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_class_name(n) for n in sides) and any(isinstance(n, ast.Constant) for n in sides):
                found.append(f"{node.lineno}: class-name check {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            args = node.args
            if node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(args) >= 2:
                name, obj = args[1], args[0]
                literal = isinstance(name, ast.Constant) and isinstance(name.value, str)
                if literal and _private(name.value) and not (isinstance(obj, ast.Name) and obj.id in ("self", "cls")):
                    found.append(f"{node.lineno}: {node.func.id}({ast.unparse(obj)}, {name.value!r})")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in (OWN, "__future__"):
                continue
            parts = node.module.split(".") + [a.name for a in node.names]
            if any(_private(p) for p in parts):
                found.append(f"{node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != OWN and any(_private(p) for p in alias.name.split(".")):
                    found.append(f"{node.lineno}: import {alias.name}")
    return found


def _runtime_files() -> list[Path]:
    return [path for path in sorted(PACKAGE.rglob("*.py")) if path.relative_to(PACKAGE).parts[0] not in NOT_RUNTIME]


def test_the_runtime_reaches_no_private_dependency_api_outside_platform():
    files = _runtime_files()
    assert len(files) > 100, "the walk found too few files: wrong package path?"
    found = [f"{path.relative_to(PACKAGE.parent)}:{where}" for path in files for where in violations(path.read_text())]
    assert not found, "use (or add) an accessor in megatron_rl/platform/:\n" + "\n".join(found)


def test_no_torch_ops_c_outside_platform():
    """The plain grep of the target, besides the AST walk."""
    found = [str(p) for p in _runtime_files() if "torch.ops._C" in p.read_text()]
    assert not found


@pytest.mark.parametrize(
    "source",
    [
        "runner._model_forward = f",
        "w = module._parameters.get('weight')",
        "torch.ops._C.prepack_moe_weight(a, b, c)",
        "data.__class__ = template.__class__",
        "import threading\nthreading._shutdown()",
        "from torch.distributed.distributed_c10d import _world",
        "from vllm._custom_ops import cpu_prepack_moe_weight",
        "import vllm._custom_ops",
        "x = getattr(experts, '_use_zentorch', False)",
        "setattr(parallel_state, '_TENSOR_MODEL_PARALLEL_GROUP', g)",
        "sub._get_main_param_and_optimizer_states(p)",
        "NAMES = ('_CUDA_RNG_STATE_TRACKER',)",
        "ok = type(method).__name__ == 'UnquantizedFusedMoEMethod'",
        "ok = 'UnquantizedFusedMoEMethod' != method.__class__.__name__",
    ],
)
def test_each_kind_of_private_use_is_found(source):
    assert violations(source), source


@pytest.mark.parametrize(
    "source",
    [
        "self._cache = {}",
        "cls._registry[name] = f",
        "getattr(self, '_workers', [])",
        "from megatron_rl.algorithms import _common\n_common._helper(x)",
        "from megatron_rl.algorithms._common import helper",
        "class Server:\n    def _start(self): ...\nHANDLERS = {1: Server._start}",
        "import os\nos._exit(0)",
        "from __future__ import annotations",
        "name = type(x).__name__",
        "ok = type(a).__name__ == type(b).__name__",
        "MARK = '_megatron_rl_loader'",
    ],
)
def test_our_own_private_names_and_public_api_pass(source):
    assert not violations(source), source
