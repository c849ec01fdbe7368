"""Commands from the training ranks to the rollout ranks, one small frozen dataclass each,
and the answers that are more than a plain value.

Training rank 0 sends them pickled over the bridge (:class:`megatron_rl.rollout.channel.Channel`),
so each must be a module-level class whose fields pickle (a weight bucket travels beside its
command as one byte tensor, described by ``specs``). The rollout side dispatches on the
type (:class:`megatron_rl.rollout.server.RolloutServer`). A layer above rollout may add
commands of its own, which both sides are told of (the client's ``extra_commands``, the
server's :class:`~megatron_rl.rollout.server.ServerExtension`); anything else is refused on
both sides by :func:`check_command`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional, Union, get_args

from megatron_rl.rollout.buckets import TensorSpec

if TYPE_CHECKING:
    from megatron_rl.data import PromptBatch
    from megatron_rl.rollout.types import EngineConfig, Sample, Sampling


class UnknownCommandError(TypeError):
    """A message that is neither one of :data:`COMMANDS` nor one the side was told of."""


@dataclasses.dataclass(frozen=True)
class Start:
    """Build each rollout rank's engine from the HF checkpoint in ``model_dir``."""

    model_dir: str
    config: EngineConfig


@dataclasses.dataclass(frozen=True)
class Generate:
    """``sampling.n`` samples per prompt; answered with a :class:`Generation`."""

    prompts: PromptBatch
    sampling: Sampling
    chunk_tokens: Optional[int] = None
    """Partial rollouts: generate this many tokens per sample at a time and run the weight
    updates that arrive meanwhile between chunks (None: the whole batch under one version)."""


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
class LoadAdapter:
    """Fill the engines' LoRA slot with the adapter sent after this command (PEFT keys, the
    tensors as a bucket) and serve it from now on (not answered unless it fails)."""

    peft_config: dict
    """Its adapter_config.json."""
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


Command = Union[
    Start,
    Generate,
    GenerateEval,
    Continue,
    PromptLogprobs,
    LoadBucket,
    CheckBucket,
    LoadAdapter,
    FinishUpdate,
    Stop,
]
COMMANDS: tuple[type, ...] = get_args(Command)
BUCKET_COMMANDS: tuple[type, ...] = (LoadBucket, CheckBucket, LoadAdapter)
"""Commands followed on the bridge by their bucket's byte tensor."""


def check_command(command: object, extra: tuple[type, ...] = ()) -> None:
    """Raise :class:`UnknownCommandError` unless ``command`` is one of :data:`COMMANDS` or of
    ``extra`` (the commands of a layer above rollout that this client or server is told of)."""
    known = COMMANDS + extra
    if type(command) not in known:
        names = ", ".join(c.__name__ for c in known)
        raise UnknownCommandError(f"{type(command).__name__} is not a rollout command; the commands are {names}")
