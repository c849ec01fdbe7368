"""Runs a batch of multi-turn episodes on a rollout engine.

Each engine call generates the next assistant turn of every episode that is ready for one,
from its exact token sequence (token in); each episode's environment reads the turn's
text and answers; an answer that ends the episode records its reward, one that goes on is
appended as observation tokens (loss mask 0) and the episode is ready again. Calls go on
until every episode is done or stopped by a limit
(:class:`~megatron_rl.environments.episode.EpisodeLimits`).

Concurrency: environment steps (tool calls: subprocesses or remote calls, which wait, and
waiting threads overlap) run in a thread pool while the engine generates. With
``overlap`` (the default) the driver does not wait for a round's slowest tool: after each
engine call it takes the episodes whose steps have answered meanwhile and generates their
next turns in the next call, waiting only when no episode is ready; so one episode's tool
runs while the others' turns are generated. Which episodes share an engine call then
depends on how long the tools took: give episodes seeds (below) for samples that do not
depend on it. Without ``overlap`` every round waits for all of its steps (lockstep), and
the calls' batches are a function of the episodes alone.

A turn must end with the EOS token (the chat template's end of an assistant turn) for the
episode to go on, as the observation tokens are the template's continuation after it;
generation stops only there (no stop strings), and a turn cut by a budget ends the
episode. Turn t of an episode with seed s is sampled with seed s + t: give episodes seeds
at least ``max_turns`` apart (``rollout.seeds.episode_seeds``).
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Optional, Protocol, Sequence

from megatron_rl.environments.episode import Episode, EpisodeLimits, EpisodeResult, ObservationEncoder, encode_prompt
from megatron_rl.environments.interface import Environment, EpisodeRecord, Step
from megatron_rl.rollout.types import Sample, Sampling


class TurnGenerator(Protocol):
    """What the driver needs of an engine (:class:`~megatron_rl.rollout.engine.RolloutEngine`)."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        seeds: Optional[Sequence[int]] = None,
        max_tokens: Optional[Sequence[int]] = None,
    ) -> list[list[Sample]]: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class DriverConfig:
    """How episodes are sampled and bounded."""

    limits: EpisodeLimits = EpisodeLimits()
    temperature: float = 1.0
    top_p: float = 1.0
    env_threads: int = 8
    """Environment steps (tool calls) run at once."""
    overlap: bool = True
    """Generate the turns of episodes whose environment has answered while other episodes'
    steps still run (module docstring); False: lockstep rounds."""

    def __post_init__(self) -> None:
        if self.env_threads < 1:
            raise ValueError(f"env_threads={self.env_threads} must be >= 1")


@dataclasses.dataclass
class DriverTimes:
    """Where the wall-clock time of one :meth:`EpisodeDriver.run` went."""

    generate_s: float = 0.0
    """In engine calls."""
    wait_s: float = 0.0
    """Waiting for environment steps with no episode ready to generate (what the tools
    cost beyond what overlapped with generation)."""
    engine_calls: int = 0

    @classmethod
    def total(cls, parts: Sequence[DriverTimes]) -> DriverTimes:
        """Several drivers' times (one per vLLM replica) added up."""
        return cls(
            generate_s=sum(p.generate_s for p in parts),
            wait_s=sum(p.wait_s for p in parts),
            engine_calls=sum(p.engine_calls for p in parts),
        )


class EpisodeDriver:
    """Episodes of one environment on one engine; ``close`` ends its thread pool."""

    def __init__(
        self, engine: TurnGenerator, tokenizer, environment: Environment, config: DriverConfig = DriverConfig()
    ):
        self.engine, self.tokenizer, self.environment, self.config = engine, tokenizer, environment, config
        self.observations = ObservationEncoder(tokenizer)
        self._pool = ThreadPoolExecutor(config.env_threads, thread_name_prefix="env-step")
        self.times = DriverTimes()
        """Of the last :meth:`run`."""

    def run(
        self, records: Sequence[EpisodeRecord], *, policy_version: int = 0, seeds: Optional[Sequence[int]] = None
    ) -> list[EpisodeResult]:
        """One episode per record, in order; ``policy_version``: the weights the engine serves."""
        if seeds is not None and len(seeds) != len(records):
            raise ValueError(f"{len(seeds)} seeds for {len(records)} records")
        self.times = DriverTimes()
        episodes = [self._open(record) for record in records]
        ready, stepping = list(range(len(episodes))), {}
        while ready or stepping:
            if ready:
                stepping.update(self._turns(episodes, ready, seeds, policy_version))
            ready = self._answered(episodes, stepping)
        return [e.result() for e in episodes]

    def _turns(
        self, episodes: list[Episode], ready: list[int], seeds: Optional[Sequence[int]], version: int
    ) -> dict[Future, int]:
        """One engine call for the ``ready`` episodes' next turns; the environment steps of
        the turns that closed, submitted to the pool (future -> episode index)."""
        start = time.perf_counter()
        samples = self._generate([episodes[i] for i in ready], None if seeds is None else [seeds[i] for i in ready])
        self.times.generate_s += time.perf_counter() - start
        self.times.engine_calls += 1
        stepping = {}
        for i, sample in zip(ready, samples):
            episodes[i].add_turn(sample, version)
            if self._turn_closed(episodes[i], sample):
                text = self.tokenizer.decode(episodes[i].last_turn, skip_special_tokens=True)
                stepping[self._pool.submit(self._step, episodes[i].state, text)] = i
        return stepping

    def _answered(self, episodes: list[Episode], stepping: dict[Future, int]) -> list[int]:
        """Apply the environment's answers that are in (all of them without ``overlap``; at
        least one, waiting only if none is); the episodes ready for another turn, in order."""
        if not stepping:
            return []
        start = time.perf_counter()
        wait(stepping, return_when=FIRST_COMPLETED if self.config.overlap else ALL_COMPLETED)
        self.times.wait_s += time.perf_counter() - start
        done = [f for f in stepping if f.done()]
        ready = []
        for future in sorted(done, key=stepping.get):
            i = stepping.pop(future)
            step, seconds = future.result()
            self._answer(episodes[i], step, seconds)
            if not episodes[i].finished:
                ready.append(i)
        return ready

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> EpisodeDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self, record: EpisodeRecord) -> Episode:
        start = self.environment.reset(record)
        ids = encode_prompt(self.tokenizer, start.messages, start.tools)
        if len(ids) >= self.config.limits.max_tokens:
            raise ValueError(
                f"{record.location or 'a record'}: the prompt's {len(ids)} tokens leave no room in "
                f"max_tokens={self.config.limits.max_tokens}"
            )
        return Episode(ids, start.state)

    def _generate(self, episodes: list[Episode], seeds: Optional[list[int]]) -> list[Sample]:
        limits = self.config.limits
        budgets = [min(limits.max_turn_tokens, limits.max_tokens - len(e.tokens)) for e in episodes]
        sampling = Sampling(
            max_tokens=max(budgets),
            temperature=self.config.temperature,
            top_p=self.config.top_p,
            stop_token_ids=(self.tokenizer.eos_token_id,),
        )
        turn_seeds = None if seeds is None else [s + e.counts.turns for s, e in zip(seeds, episodes)]
        groups = self.engine.generate([e.tokens for e in episodes], sampling, turn_seeds, budgets)
        return [group[0] for group in groups]

    def _turn_closed(self, episode: Episode, sample: Sample) -> bool:
        """Whether the turn ended with EOS; if not, a budget cut it and the episode stops."""
        if sample.token_ids and sample.token_ids[-1] == self.tokenizer.eos_token_id:
            return True
        at_episode_limit = len(episode.tokens) >= self.config.limits.max_tokens
        episode.stop("max_tokens" if at_episode_limit else "turn_length")
        return False

    def _step(self, state, text: str) -> tuple[Step, float]:
        """The environment's answer to one turn and its wall-clock seconds (tool calls)."""
        start = time.perf_counter()
        step = self.environment.step(state, text)
        return step, time.perf_counter() - start

    def _answer(self, episode: Episode, step: Step, seconds: float = 0.0) -> None:
        if step.done:
            episode.add_step(step, seconds=seconds)
            episode.finish(step.reward)
            return
        limits = self.config.limits
        if episode.counts.turns >= limits.max_turns:
            episode.add_step(step, seconds=seconds)
            episode.stop("max_turns")
            return
        ids = self.observations.encode(step.observation)
        if len(episode.tokens) + len(ids) >= limits.max_tokens:  # no room left to answer it
            episode.add_step(step, seconds=seconds)
            episode.stop("max_tokens")
            return
        episode.add_step(step, ids, seconds)
