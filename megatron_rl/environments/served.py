"""Multi-turn episodes on rollout ranks of their own: their commands, their answer, and the
server extension that runs them.

With disaggregated rollouts the tools run on the rollout ranks, beside the engines that
generate the turns (and beside nothing that trains). The training ranks send
:class:`StartEpisodes` once, after the engines' ``Start`` (:func:`start_episodes`), then one
:class:`GenerateEpisodes` per batch through the client's generic ``submit`` / ``result``
(:mod:`megatron_rl.trainer.episodes`, ahead of training as :mod:`megatron_rl.trainer.ahead`
sends any batch). The rollout ranks serve both through an :class:`EpisodeService` given to
:func:`megatron_rl.rollout.server.serve`: it builds the environment and its driver on each
rank's engine from the spec, and runs each batch to its end under the weights served then
(no update runs inside one), dealt over the rollout world's replicas
(:class:`~megatron_rl.environments.replicas.EpisodeReplicas`).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional, Union

from megatron_rl.environments.driver import DriverTimes
from megatron_rl.environments.episode import EpisodeResult
from megatron_rl.environments.interface import EpisodeRecord
from megatron_rl.environments.replicas import EpisodeReplicas
from megatron_rl.environments.spec import EpisodeSpec, build_driver

if TYPE_CHECKING:
    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.rollout.server import Handler, RolloutServer


@dataclasses.dataclass(frozen=True)
class StartEpisodes:
    """Build every rollout rank's environment and episode driver on its engine from ``spec``,
    with the tokenizer of the HF checkpoint in ``model_dir`` (after the engines' ``Start``)."""

    spec: EpisodeSpec
    model_dir: str


@dataclasses.dataclass(frozen=True)
class GenerateEpisodes:
    """One multi-turn episode per record, run to its end by the rollout ranks' drivers
    (their tools on their ranks); answered with an :class:`EpisodeGeneration`."""

    records: list[EpisodeRecord]
    seeds: Optional[list[int]] = None
    """Episode i's turns seeded from ``seeds[i]`` (``rollout.seeds.episode_seeds``); None: unseeded."""


@dataclasses.dataclass(frozen=True)
class EpisodeGeneration:
    """What a :class:`GenerateEpisodes` command answers."""

    results: list[EpisodeResult]
    """One per record, in record order."""
    times: DriverTimes
    """The rollout ranks' drivers' times, added up over the replicas."""
    seconds: float
    """Time the rollout ranks spent running them."""
    idle_s: float
    """As :attr:`megatron_rl.rollout.commands.Generation.idle_s`."""


EPISODE_COMMANDS: tuple[type, ...] = (StartEpisodes, GenerateEpisodes)
"""What the client of a run of episodes sends beside rollout's own commands."""


def start_episodes(client: RolloutClient, spec: EpisodeSpec, model_dir: Union[str, Path], timeout_s: float) -> None:
    """Have the rollout ranks build their drivers, and wait until they have (collective over
    the training world; the client must have been told of :data:`EPISODE_COMMANDS`).
    ``timeout_s``: ``rollout.start_timeout_s``, which bounds the engines' start too."""
    number = client.submit(StartEpisodes(spec, str(model_dir)))
    client.result(number, timeout_s=timeout_s, timeout_key="rollout.start_timeout_s")


class EpisodeService:
    """The rollout ranks' side of :data:`EPISODE_COMMANDS`, a
    :class:`~megatron_rl.rollout.server.ServerExtension`; holds this rank's driver once started."""

    def __init__(self):
        self.episodes: Optional[EpisodeReplicas] = None

    def handlers(self) -> Mapping[type, Handler]:
        return {StartEpisodes: self._start, GenerateEpisodes: self._generate}

    def close(self) -> None:
        if self.episodes is not None:
            self.episodes.close()

    def _start(self, server: RolloutServer, command: StartEpisodes, bucket: None) -> None:
        from transformers import AutoTokenizer

        if server.replicas is None:
            raise RuntimeError("StartEpisodes: the engines are not started")
        if self.episodes is not None:
            raise RuntimeError("StartEpisodes: the episode drivers are started already")
        tokenizer = AutoTokenizer.from_pretrained(command.model_dir)
        driver = build_driver(command.spec, server.replicas.engine, tokenizer, announce=server.leader)
        self.episodes = EpisodeReplicas(server.replicas, driver)

    def _generate(self, server: RolloutServer, command: GenerateEpisodes, bucket: None) -> EpisodeGeneration:
        """Every episode run to its end under the weights served now (no update runs inside)."""
        if self.episodes is None:
            raise RuntimeError("GenerateEpisodes: the rollout ranks were not sent StartEpisodes")
        idle = server.take_idle_s()
        started = time.perf_counter()
        results, times = self.episodes.run(command.records, command.seeds, server.version)
        return EpisodeGeneration(results, times, time.perf_counter() - started, idle)
