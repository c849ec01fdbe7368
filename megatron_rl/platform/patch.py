"""One replaced attribute of a dependency, with what it covers: the form every patch takes.

The Megatron-Core CPU layer (:mod:`.cpu_compat`) and the vLLM patches (:mod:`.vllm_compat`)
share it, so each patch of a dependency is a named entry stating its target and why, that
a test can switch off to show the defect it removes. A patch is used one of two ways:

* globally: :meth:`Patch.apply` / :meth:`Patch.revert` (idempotent) for patches that only
  change the dependency's own functions and stay on for the life of the process;
* scoped: ``with patch.scope(*state):`` for patches that must hold only around one call
  (e.g. while an engine is built). The replacement is built for that block from ``state``
  passed by its owner, so no flag outlives the block, and nesting restores in order.

``attribute`` may be dotted (``Class.method``) to replace a class attribute; it is read
and written as stored (a ``staticmethod`` stays one).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from contextlib import contextmanager
from typing import Callable, Iterator

_ABSENT = object()


@dataclasses.dataclass
class Patch:
    """One replaced attribute of a dependency's module or class, with the reason."""

    name: str
    module: str
    attribute: str
    covers: str  # the dependency's function(s) whose behaviour this changes
    make: Callable[..., object]  # (original attribute, *state) -> replacement
    why: str = ""  # the defect or cost it removes (the CPU layer's entries: a CUDA assumption)
    _original: object = None
    applied: bool = False

    def target(self) -> tuple[object, str]:
        """The object holding the attribute (module or class) and the attribute's name."""
        owner = importlib.import_module(self.module)
        *path, leaf = self.attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        return owner, leaf

    def apply(self) -> None:
        if self.applied:
            return
        owner, leaf = self.target()
        current, self._original = _read(owner, leaf)
        setattr(owner, leaf, self.make(current))
        self.applied = True

    def revert(self) -> None:
        if not self.applied:
            return
        _restore(*self.target(), self._original)
        self.applied = False

    @contextmanager
    def scope(self, *state) -> Iterator[None]:
        """Apply for one ``with`` block, the replacement built from ``state``."""
        owner, leaf = self.target()
        current, original = _read(owner, leaf)
        setattr(owner, leaf, self.make(current, *state))
        try:
            yield
        finally:
            _restore(owner, leaf, original)


def _read(owner: object, leaf: str) -> tuple[object, object]:
    """What the replacement wraps, and what :func:`_restore` puts back (``_ABSENT``: the
    owner had no attribute of its own). A class attribute is read as stored (a
    ``staticmethod`` object, not the function it wraps); an inherited one is wrapped."""
    if isinstance(owner, type):
        return inspect.getattr_static(owner, leaf, None), vars(owner).get(leaf, _ABSENT)
    value = getattr(owner, leaf, _ABSENT)
    return (None if value is _ABSENT else value), value


def _restore(owner: object, leaf: str, original: object) -> None:
    if original is not _ABSENT:
        setattr(owner, leaf, original)
    elif leaf in vars(owner):
        delattr(owner, leaf)
