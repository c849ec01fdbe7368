"""Session-wide test settings shared by every suite."""

import os
from pathlib import Path

import pytest

UNIT_TESTS = Path(__file__).parent / "unit"

SHARED_CACHES = ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "MEGATRON_RL_BASE_CACHE")
"""vLLM's model-info cache, the C++ kernels inductor builds even for an eager engine, and the
task bases runs build from their config (the embedded default's, in `make train`'s test and
a Slurm job). The trainer keeps them in its run dir, and every test has a fresh run dir, so
each launch paid the cold start: 52.6 s against 18.7 s warm for a world-1 DAPO run here,
and each task run built its base. All three are keyed by content hash and written
atomically (a base under a lock), so the launches of one session share them, on both
pytest-xdist workers (a variable already set in the environment wins, as it does for the
trainer)."""


@pytest.fixture(scope="session", autouse=True)
def shared_caches(tmp_path_factory):
    root = _session_root(tmp_path_factory) / "shared-caches"
    with pytest.MonkeyPatch.context() as patch:
        for name in SHARED_CACHES:
            if name not in os.environ:
                patch.setenv(name, str(root / name.lower()))
        yield


def _session_root(tmp_path_factory) -> Path:
    """This session's temporary root: under pytest-xdist, the directory above the workers'
    own (pytest-N/popen-gw0, popen-gw1), so that both workers find the same caches."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


GPU_SKIP_REASON = "needs a CUDA device: tools/gpu_check.py runs the gpu-marked tests on a machine with one"
GPU_DRY_RUN_ENV = "MEGATRON_RL_GPU_DRY_RUN"
"""Set to 1 to run the gpu-marked tests on a machine without CUDA, their CUDA launches on the
CPU: a check that the bodies and comparisons work before GPU time is spent on them."""


def pytest_addoption(parser):
    parser.addoption(
        "--slurm-beside-the-rest",
        action="store_true",
        help="with pytest-xdist's -n 2: one worker starts with tests/slurm, the other with the unit tests, "
        "then both take the other modules, heaviest first (make test)",
    )


def pytest_collection_modifyitems(config, items):
    _skip_gpu_tests_without_cuda(items)
    if config.getoption("slurm_beside_the_rest"):
        items.sort(key=_schedule_rank)


def _skip_gpu_tests_without_cuda(items) -> None:
    """Tests marked ``gpu`` are collected everywhere, so they cannot rot unseen, and skipped
    with the reason where torch sees no CUDA device (every CPU machine and CI), unless a dry
    run was asked for."""
    import torch

    if torch.cuda.is_available() or os.environ.get(GPU_DRY_RUN_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


SLURM_TESTS = Path(__file__).parent / "slurm"
HEAVY_FIRST = (
    "distributed/test_bridge.py",  # with test_checkpoint and test_model_layouts: one unit (below)
    "distributed/test_trainer_recipes.py",
    "distributed/test_trainer.py",
    "distributed/test_weight_sync.py",
    "distributed/test_tool_episodes.py",
    "distributed/test_trainer_async.py",
    "distributed/test_schedules.py",
    "distributed/test_trainer_failures.py",
    "distributed/test_embedded_default.py",
)
"""The heaviest modules of the rest, heaviest first (`--durations` of a CI run, 2026-11-29:
560 s for the world-8 unit down to ~100 s): handed out before the lighter ones, so that
the last module either worker starts is a short one."""
SHARED_LAUNCH_MODULES = ("test_bridge.py", "test_checkpoint.py", "test_model_layouts.py")
"""tests/distributed modules whose cases share one world-8 launch (tests/distributed/conftest.py):
one unit of work, or each worker would start the launch."""


def _schedule_rank(item) -> tuple[int, int]:
    """Collection order under --slurm-beside-the-rest: the Slurm tests, the unit tests, the
    heaviest of the rest, the rest."""
    if item.path.is_relative_to(SLURM_TESTS):
        return (0, 0)
    if item.path.is_relative_to(UNIT_TESTS):
        return (1, 0)
    name = item.path.relative_to(Path(__file__).parent).as_posix()
    return (2, HEAVY_FIRST.index(name) if name in HEAVY_FIRST else len(HEAVY_FIRST))


def _scope_of(nodeid: str) -> str:
    """The unit of work one worker takes whole: the Slurm tests (one cluster, waits that a
    second module would skew), the modules of the shared world-8 launch, any other module."""
    module = nodeid.split("::", 1)[0]
    if module.startswith("tests/slurm/"):
        return "tests/slurm"
    if module.startswith("tests/distributed/") and module.rsplit("/", 1)[1] in SHARED_LAUNCH_MODULES:
        return "tests/distributed world-8 launch"
    return module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs two pytest-xdist workers. The first takes the Slurm tests, which
    spend most of their time waiting on the cluster (requeue delays, the timeouts the drills
    wait out), while the other runs the unit tests, whose light work fills those waits and
    leaves the heavy Slurm launches (the multi-node module's, first) the cores. Then both
    take the other modules one at a time, heaviest first. xdist's own `--dist loadgroup`
    would say the units with markers, but its group suffix is lost on pytest 9's node ids."""
    if not config.getoption("slurm_beside_the_rest"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # the collection order is the schedule, not the units' sizes

    class SlurmBesideTheRest(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope_of(nodeid)

    return SlurmBesideTheRest(config, log)


class ScheduleTimeline:
    """When each worker ran each unit of work (from the reports' start and stop times),
    printed at the end of a --slurm-beside-the-rest run: where the workers waited."""

    def __init__(self):
        self.spans: dict[tuple[str, str], list[float]] = {}

    def pytest_runtest_logreport(self, report):
        node = getattr(report, "node", None)
        if node is None:
            return
        key = (node.gateway.id, _scope_of(report.nodeid))
        span = self.spans.setdefault(key, [report.start, report.stop])
        span[0], span[1] = min(span[0], report.start), max(span[1], report.stop)

    def pytest_terminal_summary(self, terminalreporter):
        if not self.spans:
            return
        origin = min(start for start, _ in self.spans.values())
        terminalreporter.section("schedule: each worker's units of work (s from the first test's start)")
        for (worker, scope), (start, stop) in sorted(self.spans.items(), key=lambda kv: kv[1][0]):
            terminalreporter.write_line(
                f"{worker} {start - origin:7.0f} {stop - origin:7.0f} {stop - start:6.0f}  {scope}"
            )


def pytest_configure(config):
    if config.getoption("slurm_beside_the_rest") and not os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(ScheduleTimeline(), "schedule-timeline")
