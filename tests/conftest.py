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


def pytest_collection_modifyitems(config, items):
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
