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

from megatron_rl_lab.testing.torchrun import launch
from tests.ci_schedule import SHARED_LAUNCH_MODULES

SHARED_BODY = Path(__file__).with_name("body_shared.py")
WORLD = 8
SHARED = {  # body -> its test module
    "body_bridge": "test_bridge.py",
    "body_checkpoint": "test_checkpoint.py",
    "body_model_layouts": "test_model_layouts.py",
}
assert set(SHARED.values()) == set(SHARED_LAUNCH_MODULES), "tests/ci_schedule.py gives one worker these modules"
TIMEOUT_S = 2400  # the bodies' own launches had 900-1200 s each


class SharedLaunch:
    """The shared world-8 launch, started on first use."""

    def __init__(self, modules: set[str], directory: Path):
        self._modules, self._directory, self._results = modules, directory, None

    def results(self, body: str) -> dict:
        """``body``'s case results ({case: {"ok": ..., ...}}, as `launch`)."""
        if self._results is None:
            bodies = [b for b, module in SHARED.items() if module in self._modules or b == body]
            self._results = launch(
                SHARED_BODY, WORLD, timeout_s=TIMEOUT_S, args=[str(WORLD), str(self._directory), ",".join(bodies)]
            )
        prefix = f"{body}:"
        out = {name[len(prefix) :]: r for name, r in self._results.items() if name.startswith(prefix)}
        if "__launch__" in self._results:
            out["__launch__"] = self._results["__launch__"]
        return out


@pytest.fixture(scope="session")
def shared_launch(request, tmp_path_factory) -> SharedLaunch:
    modules = {item.path.name for item in request.session.items}
    return SharedLaunch(modules, tmp_path_factory.mktemp("shared-launch"))


@pytest.fixture(scope="session")
def bases() -> dict[str, str]:
    """The trainer modules' tiny bases, {family: directory}, dense and MoE: built once per
    session, whichever worker asks first (trainer_runs.py)."""
    from tests.distributed.trainer_runs import small_bases

    return small_bases()
