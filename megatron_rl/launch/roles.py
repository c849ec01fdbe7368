"""One launch split into training ranks and rollout ranks (``rollout.placement: disaggregated``).

torchrun or srun starts W processes; the last R (``rollout.num_ranks``) run vLLM engines,
the first W - R train. Each role gets a default process group of its own, so Megatron's
layout spans the training ranks only and vLLM's external launcher sees the rollout ranks
only, exactly as in a colocated launch of that size: nothing in either role needs to know
about the other. Between them a *bridge* joins training rank 0 (bridge rank 0) with every
rollout rank (bridge ranks 1..R): two groups, one per direction, for commands and weights
down and answers up (:mod:`megatron_rl.rollout.channel`). All three groups meet in the launch's own store under
prefixes of their own, so no second rendezvous address is needed.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from megatron_rl import platform

TRAIN, ROLLOUT = "train", "rollout"


@dataclasses.dataclass(frozen=True)
class Roles:
    """Which launch rank does what: ranks [0, W - R) train, [W - R, W) generate."""

    world: int
    rollout_ranks: int

    def __post_init__(self) -> None:
        if not 0 < self.rollout_ranks < self.world:
            raise ValueError(
                f"{self.rollout_ranks} rollout ranks in a launch of {self.world}: "
                "at least one rank must train and one generate"
            )

    @property
    def training_ranks(self) -> int:
        return self.world - self.rollout_ranks

    def role(self, rank: int) -> str:
        return ROLLOUT if rank >= self.training_ranks else TRAIN

    def role_rank(self, rank: int) -> int:
        """The rank within its role's own world."""
        return rank - self.training_ranks if self.role(rank) == ROLLOUT else rank

    def role_size(self, rank: int) -> int:
        return self.rollout_ranks if self.role(rank) == ROLLOUT else self.training_ranks

    def bridge_rank(self, rank: int) -> Optional[int]:
        """Training rank 0 -> 0, rollout rank i -> 1 + i; other training ranks are not in the bridge."""
        if self.role(rank) == ROLLOUT:
            return 1 + self.role_rank(rank)
        return 0 if rank == 0 else None


@dataclasses.dataclass
class RoleWorld:
    """This process's place in a split launch."""

    roles: Roles
    rank: int
    """Launch rank."""
    bridge: Optional[tuple[object, object]]
    """The bridge's (down, up) process groups (None on training ranks other than 0)."""

    @property
    def role(self) -> str:
        return self.roles.role(self.rank)

    def describe_rollout_ranks(self) -> str:
        """``rollout ranks 2-3 of the launch``: how errors name them."""
        first, last = self.roles.training_ranks, self.roles.world - 1
        return f"rollout rank {first} of the launch" if first == last else f"rollout ranks {first}-{last} of the launch"


BRIDGE_TIMEOUT_S = 7 * 24 * 3600.0
"""The bridge's own timeout. Its receiving threads wait through whole training steps (and
a gloo timeout closes the group for good), so the bridge never times out by itself: the
trainer bounds each wait for an answer (``rollout.timeout_s``, rollout/client.py)."""


def init_roles(rollout_ranks: int, timeout_s: float = 3600.0) -> RoleWorld:
    """Split this launch: the default process group becomes this rank's role's world, and
    training rank 0 and the rollout ranks join the bridge. ``timeout_s`` bounds the role
    worlds' collectives; the training ranks other than 0 wait in one while rank 0 waits for
    the rollout ranks, so it must exceed that wait. Afterwards RANK/WORLD_SIZE name the
    role's world (vLLM's external launcher reads them); LOCAL_RANK is left alone (it picks
    the device)."""
    import torch.distributed as dist

    rank, world = platform.launch_env()
    roles = Roles(world, rollout_ranks)
    store, _, _ = next(dist.rendezvous("env://", rank, world))
    role = roles.role(rank)
    platform.init_distributed_on_store(
        dist.PrefixStore(f"role/{role}/", store), roles.role_rank(rank), roles.role_size(rank), timeout_s
    )
    bridge_rank = roles.bridge_rank(rank)
    bridge = None
    if bridge_rank is not None:
        bridge = tuple(
            platform.process_group_on_store(
                dist.PrefixStore(f"bridge/{direction}/", store), bridge_rank, rollout_ranks + 1, BRIDGE_TIMEOUT_S
            )
            for direction in ("down", "up")
        )
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(roles.role_rank(rank)), str(roles.role_size(rank))
    return RoleWorld(roles, rank, bridge)
