"""One torchrun launch at world 8 for the bodies several test modules use.

A launch's cold start (imports and process groups in every rank) measured 32-35 s at
world 8 on a 2-core machine (2026-11-27), paid once per module before; the shared launch
took 147 s against 234 s for the three. The shared launch runs the cases of every body
whose test module is in the session, so running one module still runs only its own cases.

World 4 keeps a launch per module: shared there (five bodies, 2026-11-27 CI) it took 381 s
against 309 s for the five launches. Each process keeps threads from what its cases built
(gloo groups that are only forgotten, such as each checkpointer's own), and the cases late
in a long launch ran several times slower."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.testing.torchrun import launch

SHARED_BODY = Path(__file__).with_name("body_shared.py")
SHARED = {  # body -> (its test module, the world sizes it shares a launch at)
    "body_bridge": ("test_bridge.py", (8,)),
    "body_checkpoint": ("test_checkpoint.py", (8,)),
    "body_model_layouts": ("test_model_layouts.py", (8,)),
}
TIMEOUT_S = 2400  # the bodies' own launches had 900-1200 s each


class SharedLaunches:
    """The shared launch of each world size, started on first use."""

    def __init__(self, modules: set[str], root: Path):
        self._modules, self._root, self._results = modules, root, {}

    def directory(self, world: int) -> Path:
        """The launch's work directory (body_checkpoint saves there)."""
        return self._root / f"world{world}"

    def results(self, body: str, world: int) -> dict:
        """``body``'s case results at ``world`` ({case: {"ok": ..., ...}}, as `launch`)."""
        if world not in SHARED[body][1]:
            raise ValueError(f"{body} shares no launch at world {world}")
        if world not in self._results:
            bodies = [b for b, (module, worlds) in SHARED.items()
                      if world in worlds and (module in self._modules or b == body)]
            self.directory(world).mkdir(parents=True, exist_ok=True)
            self._results[world] = launch(SHARED_BODY, world, timeout_s=TIMEOUT_S,
                                          args=[str(world), str(self.directory(world)), ",".join(bodies)])
        got, prefix = self._results[world], f"{body}:"
        out = {name[len(prefix):]: r for name, r in got.items() if name.startswith(prefix)}
        if "__launch__" in got:
            out["__launch__"] = got["__launch__"]
        return out


@pytest.fixture(scope="session")
def shared_launches(request, tmp_path_factory) -> SharedLaunches:
    modules = {item.path.name for item in request.session.items}
    return SharedLaunches(modules, tmp_path_factory.mktemp("shared-launches"))
