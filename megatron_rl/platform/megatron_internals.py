"""Accessors for Megatron-Core 0.16.1 internals that megatron_rl reads or swaps.

Megatron-Core offers no public API for these; each accessor is the one place that knows
the private name, says which release it was read from and why it is needed, and is tested
against the installed release in tests/unit/platform/test_megatron_internals.py. An upgrade
of Megatron-Core starts with that test.
"""

from __future__ import annotations

import types
from typing import Any

import torch

MEGATRON_CORE_VERSION = "0.16.1"
"""The Megatron-Core release these accessors were read from."""

RNG_TRACKER_GLOBALS = ("_CUDA_RNG_STATE_TRACKER", "_CUDA_RNG_STATE_TRACKER_INITIALIZED")
"""``tensor_parallel.random``'s model-parallel RNG tracker and its initialised flag."""

ParallelGlobals = dict[tuple[types.ModuleType, str], Any]
"""(Megatron module, global's name) -> value: one layout's process groups and RNG tracker."""


def _state_modules() -> tuple[types.ModuleType, types.ModuleType]:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random

    return parallel_state, random


def _state_names(module: types.ModuleType) -> list[str]:
    """The module-level state of a Megatron module: its private non-callable globals."""
    skip = (types.FunctionType, types.BuiltinFunctionType, types.ModuleType, type)
    return [
        n for n, v in vars(module).items() if n.startswith("_") and not n.startswith("__") and not isinstance(v, skip)
    ]


def capture_parallel_globals() -> ParallelGlobals:
    """Every layout-dependent global of Megatron-Core 0.16.1, as it is now.

    That is ``parallel_state``'s private module state (``_TENSOR_MODEL_PARALLEL_GROUP`` and
    its kin: groups, ranks, world sizes, the global memory buffer) and the model-parallel
    RNG tracker of ``tensor_parallel.random``. Megatron keeps one layout per process in
    them and still reads them where a ``pg_collection`` does not reach (pipeline layer
    offsets, ``sharded_state_dict`` replica ids, the schedules' p2p, gradient clipping),
    so a process holding two layouts (actor and critic) swaps them
    (:meth:`megatron_rl.parallel.state.ParallelContext.active`)."""
    parallel_state, random = _state_modules()
    captured = {(parallel_state, n): getattr(parallel_state, n) for n in _state_names(parallel_state)}
    captured.update({(random, n): getattr(random, n) for n in RNG_TRACKER_GLOBALS})
    return captured


def install_parallel_globals(captured: ParallelGlobals) -> None:
    """Make ``captured`` (from :func:`capture_parallel_globals`) the current layout of
    Megatron-Core 0.16.1: each private global is assigned back to its module."""
    for (module, name), value in captured.items():
        setattr(module, name, value)


def uninitialised_parallel_globals(captured: ParallelGlobals) -> ParallelGlobals:
    """The same globals as before any initialisation in Megatron-Core 0.16.1: None, empty
    containers, no RNG tracker (so that ``initialize_model_parallel`` builds a new layout
    without destroying the one ``captured`` holds)."""
    return {
        key: (type(value)() if isinstance(value, (dict, list)) else False if isinstance(value, bool) else None)
        for key, value in captured.items()
    }


def main_param_and_optimizer_states(optimizer, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """``{"param": fp32 main slice, "exp_avg": ..., "exp_avg_sq": ..., "step": ...}`` that a
    ``DistributedOptimizer`` of Megatron-Core 0.16.1 holds for the model parameter ``param``
    on this DP rank: the flat slice [start, end) of the parameter's local shard.

    Read through ``DistributedOptimizer._get_main_param_and_optimizer_states``, the method
    Megatron's own ``sharded_state_dict`` uses: 0.16.1's public gather-free format
    (``fully_sharded_model_space``) needs ``ShardedTensor.flattened_range``, which 0.16.1
    rejects, so the checkpoint reads the slices itself (:mod:`megatron_rl.checkpoint.optimizer_state`)."""
    return optimizer._get_main_param_and_optimizer_states(param)
