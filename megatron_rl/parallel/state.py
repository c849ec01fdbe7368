"""Process groups for a ParallelConfig, built by Megatron-Core's own initialiser.

This is the one module that calls ``megatron.core.parallel_state``; the rest of
megatron_rl receives the groups through :class:`ParallelContext`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.parallel.config import RANK_ORDER, ParallelConfig


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
    dense = RankGenerator(
        tp=config.tp, ep=1, dp=config.dp(world_size), pp=config.pp, cp=config.cp, order=RANK_ORDER
    )
    expert = RankGenerator(
        tp=config.etp, ep=config.ep, dp=config.edp(world_size), pp=config.pp, cp=1, order=RANK_ORDER
    )
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


@dataclasses.dataclass
class ParallelContext:
    """The initialised layout: its config, this rank's coordinates and the process groups."""

    config: ParallelConfig
    world_size: int
    rank: int
    coords: RankCoordinates
    pg_collection: object  # megatron.core.process_groups_config.ProcessGroupCollection

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.config.pp - 1


def initialize(config: ParallelConfig, seed: int = 1234, model=None) -> ParallelContext:
    """Validate, then build Megatron's process groups and RNG trackers for this layout."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rl.platform import megatron_scope

    world_size, rank = dist.get_world_size(), dist.get_rank()
    config.validate(world_size, model)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    with megatron_scope():
        parallel_state.initialize_model_parallel(
            **config.megatron_sizes(),
            order=RANK_ORDER,
            create_gloo_process_groups=True,
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
    )


def destroy() -> None:
    """Tear down Megatron's groups so another layout can be initialised in this process."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


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
