"""One torchrun launch per world size (8 and 4) for the bodies several test modules use.

A launch's cold start (imports and process groups in every rank) measured 32-35 s at
world 8 on a 2-core machine (2026-11-27), paid once per module before; the shared launch
took 147 s against 234 s for the three. The shared launch runs the cases of every body
whose test module is in the session, so running one module still runs only its own cases.

At world 4 the schedules' and the route replay's bodies join the launch as well.
Sharing pays at world 4 too because the gloo groups earlier cases leave behind share one
device per process (`platform/torch_compat.py`): with a polling thread per group, the cases
late in a long launch ran several times slower, and five bodies in one world-4 launch took
381 s against 309 s in five launches."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl_lab.testing.torchrun import launch
from tests.ci_schedule import SHARED_LAUNCH_MODULES

SHARED_BODY = Path(__file__).with_name("body_shared.py")
SHARED = {  # body -> its test module and the world sizes it runs at, in the launch's order
    "body_bridge": ("test_bridge.py", (4, 8)),
    "body_checkpoint": ("test_checkpoint.py", (4, 8)),
    "body_model_layouts": ("test_model_layouts.py", (4, 8)),
    "body_schedules": ("test_schedules.py", (4,)),
    "body_route_replay": ("test_route_replay.py", (4,)),
    "body_reward_model": ("test_reward_model.py", (4,)),
    "body_sft": ("test_sft.py", (4,)),
    "body_lora": ("test_lora.py", (4,)),
}
assert {m for m, _ in SHARED.values()} == set(SHARED_LAUNCH_MODULES), "tests/ci_schedule.py gives one worker these"
TIMEOUT_S = 3600  # the bodies' own launches had 900-1200 s each


class SharedLaunch:
    """The shared launch at one world size, started on first use."""

    def __init__(self, world: int, modules: set[str], directory: Path):
        self.world, self.directory = world, directory
        self._modules, self._results = modules, None

    def results(self, body: str) -> dict:
        """``body``'s case results ({case: {"ok": ..., ...}}, as `launch`)."""
        if self._results is None:
            bodies = [
                b
                for b, (module, worlds) in SHARED.items()
                if self.world in worlds and (module in self._modules or b == body)
            ]
            args = [str(self.world), str(self.directory), ",".join(bodies)]
            self._results = launch(SHARED_BODY, self.world, timeout_s=TIMEOUT_S, args=args)
        prefix = f"{body}:"
        out = {name[len(prefix) :]: r for name, r in self._results.items() if name.startswith(prefix)}
        if "__launch__" in self._results:
            out["__launch__"] = self._results["__launch__"]
        return out


def _shared(world: int, request, tmp_path_factory) -> SharedLaunch:
    modules = {item.path.name for item in request.session.items}
    return SharedLaunch(world, modules, tmp_path_factory.mktemp(f"shared-launch-{world}"))


@pytest.fixture(scope="session")
def shared_launch(request, tmp_path_factory) -> SharedLaunch:
    """World 8."""
    return _shared(8, request, tmp_path_factory)


@pytest.fixture(scope="session")
def shared_launch4(request, tmp_path_factory) -> SharedLaunch:
    """World 4 (body_checkpoint saves under its ``directory``)."""
    return _shared(4, request, tmp_path_factory)


@pytest.fixture(scope="session")
def bases() -> dict[str, str]:
    """The trainer modules' tiny bases, {family: directory}, dense and MoE: built once per
    session, whichever worker asks first (trainer_runs.py)."""
    from tests.distributed.trainer_runs import small_bases

    return small_bases()
