"""The Megatron-Core accessors of the platform layer read what 0.16.1 has, where it has it.

The layout swap they serve is checked with real process groups in the distributed tests
(two layouts in one process: the actor and critic bodies); the optimizer slices by the
checkpoint tests.
"""

import inspect

import pytest

from megatron_rl.platform import megatron_internals


@pytest.fixture
def globals_kept():
    """Megatron's globals as they were before the test."""
    kept = megatron_internals.capture_parallel_globals()
    yield kept
    megatron_internals.install_parallel_globals(kept)


def test_the_layout_globals_are_megatrons_module_state(globals_kept):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random

    names = {name for (_, name) in globals_kept}
    for name in ("_TENSOR_MODEL_PARALLEL_GROUP", "_PIPELINE_MODEL_PARALLEL_GROUP", "_EXPERT_MODEL_PARALLEL_GROUP"):
        assert name in names and hasattr(parallel_state, name), name
    for name in megatron_internals.RNG_TRACKER_GLOBALS:
        assert (random, name) in globals_kept and hasattr(random, name), name


def test_uninitialised_globals_are_megatrons_before_any_layout_and_install_round_trips(globals_kept):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random

    blank = megatron_internals.uninitialised_parallel_globals(globals_kept)
    assert blank.keys() == globals_kept.keys()
    megatron_internals.install_parallel_globals(blank)
    assert not parallel_state.model_parallel_is_initialized()
    assert random._CUDA_RNG_STATE_TRACKER is None and random._CUDA_RNG_STATE_TRACKER_INITIALIZED is False
    megatron_internals.install_parallel_globals(globals_kept)
    assert all(
        getattr(module, name) is value
        for (module, name), value in megatron_internals.capture_parallel_globals().items()
    )


def test_main_param_and_optimizer_states_is_the_distributed_optimizers_method():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    method = DistributedOptimizer._get_main_param_and_optimizer_states
    assert list(inspect.signature(method).parameters) == ["self", "model_param"]

    class Optimizer:
        def _get_main_param_and_optimizer_states(self, model_param):
            return {"param": model_param}

    assert megatron_internals.main_param_and_optimizer_states(Optimizer(), "p") == {"param": "p"}


def test_every_accessor_names_the_release_it_was_read_from():
    import megatron.core

    assert megatron.core.__version__ == megatron_internals.MEGATRON_CORE_VERSION
    for name, fn in vars(megatron_internals).items():
        if inspect.isfunction(fn) and not name.startswith("_") and fn.__module__ == megatron_internals.__name__:
            assert "0.16.1" in inspect.getdoc(fn), name
