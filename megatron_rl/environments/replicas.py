"""A batch of multi-turn episodes dealt over a world's vLLM replicas, each on its own driver.

Every rank holds the same records; each replica runs a contiguous share of them on the
:class:`~megatron_rl.environments.driver.EpisodeDriver` of its rank (its tools on that
rank), and the results come back in record order on every rank, as a generation's samples
do (:class:`~megatron_rl.rollout.replicas.Replicas`). The world is the training ranks'
with colocated engines and the rollout ranks' own with disaggregated ones
(:mod:`megatron_rl.environments.served`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch.distributed as dist

from megatron_rl.environments.driver import DriverTimes, EpisodeDriver
from megatron_rl.environments.episode import EpisodeResult
from megatron_rl.environments.interface import EpisodeRecord
from megatron_rl.rollout.replicas import Replicas


@dataclasses.dataclass(frozen=True)
class EpisodeReplicas:
    """This rank's episode driver, on this rank's engine, and the replicas it is one of."""

    replicas: Replicas
    driver: EpisodeDriver

    def __post_init__(self) -> None:
        if self.replicas.tp != 1:  # a replica's ranks would each run the tools and could see different answers
            raise ValueError(f"episodes run on replicas of one rank each, not engine TP {self.replicas.tp}")

    def run(
        self, records: Sequence[EpisodeRecord], seeds: Optional[Sequence[int]], version: int
    ) -> tuple[list[EpisodeResult], DriverTimes]:
        """One episode per record, each replica running a contiguous share on its own driver;
        the results in record order and the drivers' times summed, the same on every rank.
        Seeded episodes (``seeds``) are the same whichever replica runs them; ``version``: the
        policy version the engines serve."""
        mine = self.replicas.share(len(records))
        my_seeds = None if seeds is None else [seeds[i] for i in mine]
        local = self.driver.run([records[i] for i in mine], policy_version=version, seeds=my_seeds)
        times = self.driver.times
        if self.replicas.num_replicas == 1:
            return local, times
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, times)
        return self.replicas.gather(len(records), mine, local), DriverTimes.total(everyone)

    def close(self) -> None:
        """End the driver's thread pool and the environment's tools."""
        self.driver.close()
        self.driver.environment.close()
