"""Commands from the training ranks to the rollout ranks, one small frozen dataclass each,
and the answers that are more than a plain value.

Training rank 0 sends them pickled over the bridge (:class:`megatron_rl.rollout.channel.Channel`),
so each must be a module-level class whose fields pickle (a weight bucket travels beside its
command as one byte tensor, described by ``specs``). The rollout side dispatches on the
type (:class:`megatron_rl.rollout.server.RolloutServer`); anything else is refused on both
sides by :func:`check_command`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional, Union, get_args

from megatron_rl.rollout.buckets import TensorSpec

if TYPE_CHECKING:
    from megatron_rl.data import PromptBatch
    from megatron_rl.environments.driver import DriverTimes
    from megatron_rl.environments.episode import EpisodeResult
    from megatron_rl.environments.interface import EpisodeRecord
    from megatron_rl.environments.spec import EpisodeSpec
    from megatron_rl.rollout.types import EngineConfig, Sample, Sampling


class UnknownCommandError(TypeError):
    """A message that is not one of :data:`COMMANDS`."""


@dataclasses.dataclass(frozen=True)
class Start:
    """Build each rollout rank's engine from the HF checkpoint in ``model_dir`` (and, for a
    run of multi-turn episodes, its environment and episode driver beside it)."""

    model_dir: str
    config: EngineConfig
    episodes: Optional[EpisodeSpec] = None


@dataclasses.dataclass(frozen=True)
class Generate:
    """``sampling.n`` samples per prompt; answered with a :class:`Generation`."""

    prompts: PromptBatch
    sampling: Sampling
    chunk_tokens: Optional[int] = None
    """Partial rollouts: generate this many tokens per sample at a time and run the weight
    updates that arrive meanwhile between chunks (None: the whole batch under one version)."""


@dataclasses.dataclass(frozen=True)
class GenerateEpisodes:
    """One multi-turn episode per record, run to its end by the rollout ranks' drivers
    (their tools on their ranks); answered with an
    :class:`EpisodeGeneration`."""

    records: list[EpisodeRecord]
    seeds: Optional[list[int]] = None
    """Episode i's turns seeded from ``seeds[i]`` (``rollout.seeds.episode_seeds``); None: unseeded."""


@dataclasses.dataclass(frozen=True)
class GenerateEval:
    """Held-out evaluation's samples, prompt i's seeded from ``seeds[i]``; answered with an
    :class:`~megatron_rl.rollout.types.EvalSamples` stamped with the policy version served."""

    prompt_ids: list[list[int]]
    sampling: Sampling
    seeds: list[int]


@dataclasses.dataclass(frozen=True)
class Continue:
    """Every unfinished sample extended by one more window (T-PPO)."""

    samples: list[Sample]
    sampling: Sampling


@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """The logprob of every token after the first of each sequence (the parity guard)."""

    sequences: list[list[int]]


@dataclasses.dataclass(frozen=True)
class LoadBucket:
    """Load the weight bucket sent after this command (not answered unless it fails)."""

    specs: tuple[TensorSpec, ...] = ()
    """What the byte tensor holds; filled in by the client when it packs the bucket."""


@dataclasses.dataclass(frozen=True)
class CheckBucket:
    """Read back what the engines serve for the bucket sent after this command."""

    specs: tuple[TensorSpec, ...] = ()
    """As :attr:`LoadBucket.specs`."""


@dataclasses.dataclass(frozen=True)
class FinishUpdate:
    """The weight update is complete: what is generated from now on samples the new version."""


@dataclasses.dataclass(frozen=True)
class Stop:
    """Serve no more commands (answered with ``stopped``)."""


@dataclasses.dataclass(frozen=True)
class Generation:
    """What a :class:`Generate` command answers."""

    groups: list[list[Sample]]
    seconds: float
    """Time the rollout ranks spent generating them."""
    idle_s: float
    """Time the rollout ranks waited for commands since the previous generation (between
    every two commands: before weight buckets too, not only before this one)."""


@dataclasses.dataclass(frozen=True)
class EpisodeGeneration:
    """What a :class:`GenerateEpisodes` command answers."""

    results: list[EpisodeResult]
    """One per record, in record order."""
    times: DriverTimes
    """The rollout ranks' drivers' times, added up over the replicas."""
    seconds: float
    idle_s: float
    """As :class:`Generation`'s."""


Command = Union[
    Start,
    Generate,
    GenerateEpisodes,
    GenerateEval,
    Continue,
    PromptLogprobs,
    LoadBucket,
    CheckBucket,
    FinishUpdate,
    Stop,
]
COMMANDS: tuple[type, ...] = get_args(Command)
BUCKET_COMMANDS: tuple[type, ...] = (LoadBucket, CheckBucket)
"""Commands followed on the bridge by their bucket's byte tensor."""


def check_command(command: object) -> None:
    """Raise :class:`UnknownCommandError` unless ``command`` is one of :data:`COMMANDS`."""
    if type(command) not in COMMANDS:
        known = ", ".join(c.__name__ for c in COMMANDS)
        raise UnknownCommandError(f"{type(command).__name__} is not a rollout command; the commands are {known}")
