"""Process groups for a ParallelConfig, built by Megatron-Core's own initialiser.

This is the one module that calls ``megatron.core.parallel_state``; the rest of
megatron_rl receives the groups through :class:`ParallelContext`.

Several layouts in one process (actor and critic each in their own): Megatron-Core 0.16.1
still reads its module-level groups in places a ``pg_collection`` does not reach (the
layer offsets of a pipeline stage, the replica ids of ``sharded_state_dict``, the
pipeline schedules' p2p, gradient clipping). So each context keeps its own copy of those
globals and of the model-parallel RNG tracker, and :meth:`ParallelContext.active`
installs them while that layout's model is built, run, stepped or saved (through
:mod:`megatron_rl.platform.megatron_internals`, which knows their names). Switching is a
few dozen attribute assignments; no process group is created or destroyed by it.

The swap is process state, so what is built outside the right ``active()`` would take
another layout's groups without a word. :func:`require_current` closes that hole where a
model is made: ``models.build_model`` refuses a layout whose sizes are not those of
Megatron's current groups.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron_rl.parallel.config import RANK_ORDER, ParallelConfig
from megatron_rl.platform.megatron_internals import (
    capture_parallel_globals,
    install_parallel_globals,
    uninitialised_parallel_globals,
)
from megatron_rl.platform.torch_internals import is_registered_process_group


@dataclasses.dataclass(frozen=True)
class RankCoordinates:
    """Where one rank sits in the dense and in the expert mapping."""

    rank: int
    tp: int
    cp: int
    dp: int
    pp: int
    etp: int
    ep: int
    edp: int


def rank_map(config: ParallelConfig, world_size: int) -> list[RankCoordinates]:
    """Every rank's coordinates, computed with Megatron's RankGenerator (no process group)."""
    from megatron.core.parallel_state import RankGenerator

    config.validate(world_size)
    dense = RankGenerator(tp=config.tp, ep=1, dp=config.dp(world_size), pp=config.pp, cp=config.cp, order=RANK_ORDER)
    expert = RankGenerator(tp=config.etp, ep=config.ep, dp=config.edp(world_size), pp=config.pp, cp=1, order=RANK_ORDER)
    coords: dict[int, dict[str, int]] = {r: {} for r in range(world_size)}
    for generator, tokens in ((dense, ("tp", "cp", "dp", "pp")), (expert, ("tp", "ep", "dp"))):
        for token in tokens:
            key = {"tp": "etp", "dp": "edp"}.get(token, token) if generator is expert else token
            for group in generator.get_ranks(token):
                for index, rank in enumerate(group):
                    coords[rank][key] = index
    return [RankCoordinates(rank=r, **coords[r]) for r in range(world_size)]


def format_rank_map(config: ParallelConfig, world_size: int) -> str:
    """A table of each rank's coordinates in both mappings."""
    header = f"{config.describe(world_size)}\n rank | tp cp dp pp | etp ep edp\n"
    rows = [
        f"{c.rank:5d} | {c.tp:2d} {c.cp:2d} {c.dp:2d} {c.pp:2d} | {c.etp:3d} {c.ep:2d} {c.edp:3d}"
        for c in rank_map(config, world_size)
    ]
    return header + "\n".join(rows)


_ACTIVE: Optional["ParallelContext"] = None
"""The context whose groups Megatron's globals hold now."""


@dataclasses.dataclass
class ParallelContext:
    """The initialised layout: its config, this rank's coordinates and the process groups."""

    config: ParallelConfig
    world_size: int
    rank: int
    coords: RankCoordinates
    pg_collection: object  # megatron.core.process_groups_config.ProcessGroupCollection
    megatron_globals: dict = dataclasses.field(default_factory=dict, repr=False)
    """Megatron's module-level groups and RNG tracker for this layout (see the module docstring)."""

    @contextlib.contextmanager
    def active(self) -> Iterator["ParallelContext"]:
        """Make this layout Megatron's current one; the previous one is back on exit
        (nothing changes when this layout is already the current one)."""
        global _ACTIVE
        if _ACTIVE is self:
            yield self
            return
        previous, previous_ctx = capture_parallel_globals(), _ACTIVE
        install_parallel_globals(self.megatron_globals)
        _ACTIVE = self
        try:
            yield self
        finally:
            self.megatron_globals = capture_parallel_globals()  # e.g. a memory buffer created lazily inside
            install_parallel_globals(previous)
            _ACTIVE = previous_ctx


def initialize(config: ParallelConfig, seed: int = 1234, model=None, timeout_s: float = 600.0) -> ParallelContext:
    """Validate, then build Megatron's process groups and RNG trackers for this layout
    (replacing any layout initialised before: see :func:`initialize_alongside` to keep it).
    ``timeout_s`` bounds every collective of the new groups (trainer.dist_timeout_s)."""
    from megatron.core import parallel_state

    config.validate(dist.get_world_size(), model)
    global _ACTIVE
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _ACTIVE = _build_groups(config, seed, timeout_s)
    return _ACTIVE


def initialize_alongside(
    config: ParallelConfig, seed: int = 1234, model=None, timeout_s: float = 600.0
) -> ParallelContext:
    """Build a second layout's process groups without touching the current one.

    The current layout stays active; use the returned context's :meth:`~ParallelContext.active`
    around everything done with the new layout's model. The process's default torch RNG is
    left as it was (the new layout's tracker is seeded like :func:`initialize` seeds it)."""
    config.validate(dist.get_world_size(), model)
    current = capture_parallel_globals()
    rng = torch.get_rng_state()
    install_parallel_globals(uninitialised_parallel_globals(current))
    try:
        ctx = _build_groups(config, seed, timeout_s)  # captures the new layout's globals
    finally:
        install_parallel_globals(current)
        torch.set_rng_state(rng)
    return ctx


def _build_groups(config: ParallelConfig, seed: int, timeout_s: float) -> ParallelContext:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rl.platform import megatron_scope

    world_size, rank = dist.get_world_size(), dist.get_rank()
    with megatron_scope():
        parallel_state.initialize_model_parallel(
            **config.megatron_sizes(),
            order=RANK_ORDER,
            create_gloo_process_groups=True,
            distributed_timeout_minutes=timeout_s / 60,  # a float is fine: it goes into a timedelta
        )
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    coords = rank_map(config, world_size)[rank]
    return ParallelContext(
        config=config,
        world_size=world_size,
        rank=rank,
        coords=coords,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        megatron_globals=capture_parallel_globals(),
    )


def destroy() -> None:
    """Tear down the current layout's groups so another layout can be initialised in this process."""
    from megatron.core import parallel_state

    global _ACTIVE
    groups = _process_groups(capture_parallel_globals().values())
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _destroy_groups(groups)
    if _ACTIVE is not None:
        _ACTIVE.megatron_globals = capture_parallel_globals()
    _ACTIVE = None


def _process_groups(values) -> list:
    """The process groups (not the world) among ``values`` and the lists and dicts in them."""
    import torch.distributed as dist

    found, todo = {}, list(values)  # id -> group, in the order first seen
    while todo:
        value = todo.pop()
        if isinstance(value, (list, tuple)):
            todo.extend(value)
        elif isinstance(value, dict):
            todo.extend(value.values())
        elif isinstance(value, dist.ProcessGroup) and value is not dist.GroupMember.WORLD:
            found.setdefault(id(value), value)
    return list(found.values())


def _destroy_groups(groups: list) -> None:
    """Destroy the groups Megatron's destroy_model_parallel only forgets.

    Megatron-Core 0.16.1 destroys its ``*_GLOO`` groups but sets the others to None, and
    torch keeps them registered: with gloo each holds its own threads, 50-100 per layout
    at world 4. A process that builds many layouts in turn (the test bodies, the benches)
    had thousands, and its later layouts ran several times slower (measured 2026-11-27)."""
    import torch.distributed as dist

    for group in groups:
        if is_registered_process_group(group):  # not destroyed already (Megatron's gloo groups)
            dist.destroy_process_group(group)


def current_sizes() -> Optional[dict[str, int]]:
    """The sizes of Megatron's current groups by ParallelConfig field name; None when no
    layout is initialised."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    return {
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "context_parallel_size": ps.get_context_parallel_world_size(),
        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
        "expert_tensor_parallel_size": ps.get_expert_tensor_parallel_world_size(),
    }


def require_current(config: ParallelConfig, what: str) -> None:
    """Raise RuntimeError unless Megatron's current groups are ``config``'s sizes: ``what``
    would otherwise be built (or run) in another layout than the one it names."""
    live = current_sizes()
    if live is None:
        raise RuntimeError(f"{what}: no parallel layout is initialised; call parallel.initialize first")
    wanted = config.megatron_sizes()
    wrong = {name: (live[name], wanted[name]) for name in live if live[name] != wanted[name]}
    if wrong:
        sizes = ", ".join(f"{name}={want} (current {have})" for name, (have, want) in wrong.items())
        raise RuntimeError(
            f"{what} is for another layout than Megatron's current one: {sizes}; "
            "build and run it inside its own ParallelContext.active()"
        )


def check_coordinates(ctx: ParallelContext) -> Optional[str]:
    """Compare the computed rank map with Megatron's live groups; None when they agree."""
    from megatron.core import parallel_state as ps

    live = {
        "tp": ps.get_tensor_model_parallel_rank(),
        "cp": ps.get_context_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "etp": ps.get_expert_tensor_parallel_rank(),
        "ep": ps.get_expert_model_parallel_rank(),
        "edp": ps.get_expert_data_parallel_rank(),
    }
    wrong = {k: (v, getattr(ctx.coords, k)) for k, v in live.items() if getattr(ctx.coords, k) != v}
    return None if not wrong else f"rank {ctx.rank}: live vs computed {wrong}"
