"""How `make test`'s two pytest-xdist workers share the suite (``--slurm-beside-the-rest``),
and the report of where each worker's time and CPU went.

One worker starts with the Slurm tests, which spend most of their time waiting on the
cluster (requeue delays, the timeouts the drills wait out), while the other runs the unit
tests, whose light work fills those waits. Then both take the other modules one at a time,
heaviest first. On two cores the run is bound by CPU work: the timeline at the end gives
each unit's CPU seconds and how busy the cores were."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
SLURM_TESTS = TESTS / "slurm"
UNIT_TESTS = TESTS / "unit"
OPTION = "--slurm-beside-the-rest"

HEAVY_FIRST = (
    "distributed/test_bridge.py",  # with the other SHARED_LAUNCH_MODULES: one unit (below)
    "distributed/test_trainer_recipes.py",
    "distributed/test_tool_episodes.py",
    "distributed/test_trainer.py",
    "distributed/test_weight_sync.py",
    "distributed/test_trainer_async.py",
    "distributed/test_trainer_failures.py",
    "distributed/test_embedded_default.py",
    "distributed/test_tppo_drift.py",
)
"""The heaviest modules of the rest, heaviest first (by their wall time in a CI run: about
280-310 s for the first three, about 60 s for the last two): handed out before the lighter ones, so
that the last module either worker starts is a short one."""
assert all((TESTS / name).is_file() for name in HEAVY_FIRST), "HEAVY_FIRST names a module that is not there"
SHARED_LAUNCH_MODULES = (
    "test_bridge.py",
    "test_checkpoint.py",
    "test_model_layouts.py",
    "test_schedules.py",
    "test_route_replay.py",
    "test_reward_model.py",
    "test_sft.py",
    "test_lora.py",
)
"""tests/distributed modules whose cases share one launch per world size (tests/distributed/conftest.py):
one unit of work, or each worker would start the launches."""


def add_option(parser) -> None:
    parser.addoption(
        OPTION,
        action="store_true",
        help="with pytest-xdist's -n 2: one worker starts with tests/slurm, the other with the unit tests, "
        "then both take the other modules, heaviest first (make test)",
    )


def enabled(config) -> bool:
    return bool(config.getoption(OPTION))


def queue_position(item) -> tuple[int, int]:
    """Collection order under --slurm-beside-the-rest: the Slurm tests, the unit tests, the
    heaviest of the rest, the rest."""
    if item.path.is_relative_to(SLURM_TESTS):
        return (0, 0)
    if item.path.is_relative_to(UNIT_TESTS):
        return (1, 0)
    name = item.path.relative_to(TESTS).as_posix()
    return (2, HEAVY_FIRST.index(name)) if name in HEAVY_FIRST else (3, 0)


def scope_of(nodeid: str) -> str:
    """The unit of work one worker takes whole: the Slurm tests (one cluster, waits that a
    second module would skew), the modules of the shared launches, any other module."""
    module = nodeid.split("::", 1)[0]
    if module.startswith("tests/slurm/"):
        return "tests/slurm"
    if module.startswith("tests/distributed/") and module.rsplit("/", 1)[1] in SHARED_LAUNCH_MODULES:
        return "tests/distributed shared launches"
    return module


def make_scheduler(config, log):
    """xdist's scope scheduler over :func:`scope_of`'s units, in collection order. xdist's own
    `--dist loadgroup` would say the units with markers, but its group suffix is lost on
    pytest 9's node ids."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # the collection order is the schedule, not the units' sizes

    class SlurmBesideTheRest(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return SlurmBesideTheRest(config, log)


def process_cpu_s() -> float:
    """CPU seconds of this process and of the children it has waited for (their children too:
    a torchrun launch's ranks), user and system."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class WorkerCpu:
    """On a worker: the CPU seconds since its previous report, in each report's
    ``user_properties`` (what the controller's timeline sums per unit). A worker's first unit
    also holds its collection. Jobs that Slurm runs are the cluster's processes, not the
    worker's: they are not counted."""

    def __init__(self):
        self.last = process_cpu_s()

    @pytest.hookimpl(tryfirst=True)  # before xdist sends the report to the controller
    def pytest_runtest_logreport(self, report):
        now = process_cpu_s()
        report.user_properties.append(("cpu_s", now - self.last))
        self.last = now


def machine_busy_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all cores (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields) - idle) / ticks, sum(fields) / ticks


class ScheduleTimeline:
    """On the controller: when each worker ran each unit of work and the CPU seconds it and
    its launches used, printed at the end, with how busy the machine's cores were: where the
    workers waited and what the run's CPU work was."""

    def __init__(self):
        self.spans: dict[tuple[str, str], list[float]] = {}
        self.cpu: dict[tuple[str, str], float] = {}
        self.machine_start = machine_busy_s()

    def pytest_runtest_logreport(self, report):
        node = getattr(report, "node", None)
        if node is None:
            return
        key = (node.gateway.id, scope_of(report.nodeid))
        span = self.spans.setdefault(key, [report.start, report.stop])
        span[0], span[1] = min(span[0], report.start), max(span[1], report.stop)
        self.cpu[key] = self.cpu.get(key, 0.0) + sum(v for k, v in report.user_properties if k == "cpu_s")

    def pytest_terminal_summary(self, terminalreporter):
        if not self.spans:
            return
        origin = min(start for start, _ in self.spans.values())
        terminalreporter.section("schedule: each worker's units of work (s from the first test's start, CPU s)")
        for key, (start, stop) in sorted(self.spans.items(), key=lambda kv: kv[1][0]):
            worker, scope = key
            terminalreporter.write_line(
                f"{worker} {start - origin:7.0f} {stop - origin:7.0f} {stop - start:6.0f} {self.cpu[key]:7.0f}  {scope}"
            )
        busy, total = (end - start for end, start in zip(machine_busy_s(), self.machine_start))
        terminalreporter.write_line(
            f"the workers' CPU: {sum(self.cpu.values()):.0f} s; the machine's {os.cpu_count()} cores were busy "
            f"{busy:.0f} of {total:.0f} core-seconds ({100 * busy / total:.0f}%) from the start of the session"
        )
