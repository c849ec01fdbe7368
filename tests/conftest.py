"""Session-wide test settings shared by every suite."""

import os
from pathlib import Path

import pytest

from tests import ci_schedule

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
    ci_schedule.add_option(parser)


def pytest_collection_modifyitems(config, items):
    _skip_gpu_tests_without_cuda(items)
    if ci_schedule.enabled(config):
        items.sort(key=ci_schedule.queue_position)


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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return ci_schedule.make_scheduler(config, log) if ci_schedule.enabled(config) else None


def pytest_configure(config):
    if not ci_schedule.enabled(config):
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(ci_schedule.WorkerCpu(), "schedule-worker-cpu")
    else:
        config.pluginmanager.register(ci_schedule.ScheduleTimeline(), "schedule-timeline")
