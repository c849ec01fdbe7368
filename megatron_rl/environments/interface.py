"""What an environment is: it opens an episode from a prompt record and answers each
assistant turn, with an observation or with the episode's end and reward.

An episode (:mod:`megatron_rl.environments.episode`) is kept as tokens; an environment
only ever sees text and chat messages. ``reset`` gives the opening messages (and the tools
the prompt lists), ``step`` reads one assistant turn's text and answers with chat
messages to append (tool results, a user message) or with ``done`` and the reward. A
single-turn task is the case whose first ``step`` is always ``done``
(:class:`~megatron_rl.environments.single_turn.SingleTurn`).

Environments are shared by all episodes of a batch and called from several threads at
once (the driver steps episodes concurrently), so what belongs to one episode lives in the
``state`` that ``reset`` returns, never on the environment.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Mapping, Optional, Protocol, Sequence

from megatron_rl.environments.tool_calls import ToolRunner, ToolSpec

Message = Mapping[str, Any]
"""A chat message: ``{"role": ..., "content": ...}`` (``tool_calls`` on an assistant's)."""


@dataclasses.dataclass(frozen=True)
class EpisodeRecord:
    """Where an episode starts: the prompt's chat messages and the ground truth."""

    messages: tuple[Message, ...]
    answer: str
    location: str = ""
    """Where the record came from (file:line), for messages about it."""

    @classmethod
    def from_messages(cls, messages: Sequence[Message], answer: str, location: str = "") -> EpisodeRecord:
        return cls(tuple(dict(m) for m in messages), str(answer), location)


@dataclasses.dataclass(frozen=True)
class EpisodeStart:
    """An opened episode: the messages the prompt is rendered from, the tools it lists, and
    the environment's own state of this episode (passed back to every ``step``)."""

    messages: tuple[Message, ...]
    tools: tuple[ToolSpec, ...] = ()
    state: Any = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Step:
    """The environment's answer to one assistant turn."""

    done: bool
    reward: Optional[float] = None
    """The episode's reward; set exactly when ``done``."""
    observation: tuple[Message, ...] = ()
    """Messages appended after the turn (tool results, a user message); empty when done."""
    tool_calls: int = 0
    """Calls the turn made, well-formed or not."""
    tool_errors: int = 0
    """Calls that were malformed or whose run failed."""
    tool_timeouts: int = 0
    """Calls whose run hit its time limit."""

    def __post_init__(self) -> None:
        if self.done != (self.reward is not None):
            raise ValueError(f"a Step has a reward exactly when done (done={self.done}, reward={self.reward})")
        if self.done == bool(self.observation):
            raise ValueError("a Step that is not done needs observation messages; one that is done has none")

    @classmethod
    def finish(cls, reward: float) -> Step:
        return cls(done=True, reward=float(reward))


class Environment(Protocol):
    """Opens episodes and answers their turns (thread-safe: see the module docstring)."""

    def reset(self, record: EpisodeRecord) -> EpisodeStart:
        """The opening of one episode."""
        ...

    def step(self, state: Any, assistant_text: str) -> Step:
        """The answer to one assistant turn (its text, special tokens dropped)."""
        ...

    def close(self) -> None:
        """Release what the environment holds (reward worker pools, tool runners)."""
        ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvironmentSetup:
    """What every environment of the registry is built from (one signature); each reads the
    fields it needs and refuses a setup it cannot work with."""

    reward: str = "digits"
    """Reward function by name (``megatron_rl.rewards.REWARDS``) scoring the final answer."""
    reward_options: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    """Options of the reward function (e.g. ``timeout_s`` for ``math``)."""
    tools: tuple[ToolSpec, ...] = ()
    """Tools listed in the prompt and callable by the policy."""
    tool_runner: Optional[ToolRunner] = None
    """Runs the well-formed calls (the sandbox); needed with tools."""
    tool_parser: str = "hermes"
    """How calls are written (``tool_calls.TOOL_PARSERS``)."""
