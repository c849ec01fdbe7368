"""Session-wide test settings shared by every suite."""

import os

import pytest

COMPILE_CACHES = ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR")
"""vLLM's model-info cache and the C++ kernels inductor builds even for an eager engine.
The trainer keeps them in its run dir, and every test has a fresh run dir, so each launch
paid the cold start: 52.6 s against 18.7 s warm for a world-1 DAPO run here. Both caches
are keyed by content hash and written atomically, so the launches of one session share
them (a variable already set in the environment wins, as it does for the trainer)."""


@pytest.fixture(scope="session", autouse=True)
def shared_compile_caches(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile-caches")
    with pytest.MonkeyPatch.context() as patch:
        for name in COMPILE_CACHES:
            if name not in os.environ:
                patch.setenv(name, str(root / name.lower()))
        yield


GPU_SKIP_REASON = "needs a CUDA device: tools/gpu_check.py runs the gpu-marked tests on a machine with one"
GPU_DRY_RUN_ENV = "MEGATRON_RL_GPU_DRY_RUN"
"""Set to 1 to run the gpu-marked tests on a machine without CUDA, their CUDA launches on the
CPU: a check that the bodies and comparisons work before GPU time is spent on them."""


def pytest_addoption(parser):
    parser.addoption(
        "--slurm-beside-the-rest",
        action="store_true",
        help="with pytest-xdist's -n 2: one worker starts with tests/slurm, the other with tests/distributed; "
        "the unit modules fill in after (make test)",
    )


def pytest_collection_modifyitems(config, items):
    _skip_gpu_tests_without_cuda(items)
    if config.getoption("slurm_beside_the_rest"):
        items.sort(key=lambda item: _order(item.nodeid))


SLURM_TESTS = "tests/slurm/"
DISTRIBUTED_TESTS = "tests/distributed/"
FIRST = (SLURM_TESTS, DISTRIBUTED_TESTS)
"""Scopes handed out first, one each to the two workers, each run whole on its worker: the
Slurm tests (one cluster start) and the distributed modules (their launches share the
machine's two cores, and a shared world-8 launch serves three of them)."""


def _order(nodeid: str) -> int:
    return next((i for i, tree in enumerate(FIRST) if nodeid.startswith(tree)), len(FIRST))


def _scope(nodeid: str) -> str:
    """What one worker runs together: one of FIRST, else a module."""
    return next((tree for tree in FIRST if nodeid.startswith(tree)), nodeid.split("::", 1)[0])


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
    """`make test` runs two pytest-xdist workers. One runs the Slurm tests, the other the
    distributed modules one after another; the unit modules go to whichever is free. The
    Slurm tests spend most of their time waiting on the cluster (requeue delays, timeouts
    the drills wait out), so the distributed launches run beside them as if alone, and the
    Slurm worker, done well before the distributed one, takes most unit modules. Launches
    on both workers at once ran several times slower on the 2-core machine (a trial that
    split the distributed modules: load average 28). xdist's own `--dist loadgroup` would
    say this with markers, but its group suffix is lost on pytest 9's node ids."""
    if not config.getoption("slurm_beside_the_rest"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # hand out scopes in the collection order set above

    class SlurmBesideTheRest(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    return SlurmBesideTheRest(config, log)
