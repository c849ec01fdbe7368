"""An episode as tokens, from its prompt to its end (token in, token out).

The episode is the prompt's ids, then per assistant turn the ids vLLM sampled (with their
logprobs, the policy version and MoE routes; trained on: loss mask 1) and the
environment's answer as the chat template wraps it (loss mask 0). The next turn is
generated from exactly this sequence; nothing is re-rendered or re-tokenized from text,
so the trainer scores the very tokens that were sampled, even where tokenizing the
conversation's text would give other ids (BPE need not re-find a sampled tokenization).

Observation tokens (:class:`ObservationEncoder`): the template's text for observation
messages that follow an assistant turn, tokenized once. The text is derived, not written
by hand: render a fixed two-message conversation ``[user, assistant "ok"]`` (A) and the
same followed by the observation messages with the generation prompt (B); the wrapper
text is B after the end of A's assistant content and its EOS, which is where a sampled turn
ends (generation stops at the EOS). So it holds the template's end-of-turn separator, the
tool turn's framing and the next assistant header, exactly as the template writes them.
Its tokens equal the whole conversation's because byte-level BPE splits text at special
tokens first: text after the EOS tokenizes the same alone as after any prefix. This is
checked on every call (tokens of B == tokens of B's prefix through the EOS + the
wrapper's tokens) and a template or tokenizer that breaks it (one whose last assistant
turn renders differently, a SentencePiece prefix space) raises instead of drifting.

The flat arrays (:class:`EpisodeResult`) follow schedules/batch.py's prediction
alignment: position t is the prediction of token t + 1.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from megatron_rl.environments.interface import Message, Step
from megatron_rl.environments.tool_calls import ToolSpec

if TYPE_CHECKING:
    from megatron_rl.rollout.types import Sample

NOT_SAMPLED = -1
"""``versions`` of a position whose next token was not sampled (prompt, observation)."""
ENDS = ("done", "max_turns", "max_tokens", "turn_length")
"""How an episode ends: the environment ended it, or a limit did (truncated)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeLimits:
    """How long an episode may grow."""

    max_turns: int = 4
    """Assistant turns; an environment still answering after the last truncates the episode."""
    max_tokens: int = 1024
    """All tokens of the episode, prompt included (at most the engine's max_model_len)."""
    max_turn_tokens: int = 256
    """Tokens of one assistant turn; a turn cut here truncates the episode."""

    def __post_init__(self) -> None:
        if min(self.max_turns, self.max_tokens, self.max_turn_tokens) < 1:
            raise ValueError(f"episode limits must be >= 1: {self}")


def encode_prompt(tokenizer, messages: Sequence[Message], tools: Sequence[ToolSpec] = ()) -> list[int]:
    """Ids of the chat template with the generation prompt and, if any, the tools (as
    ``data.prompts.encode_prompt`` without them). Raises if the template ignores the tools."""
    schemas = [tool.schema() for tool in tools] or None
    text = tokenizer.apply_chat_template(list(messages), tools=schemas, tokenize=False, add_generation_prompt=True)
    if schemas and text == tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True):
        raise ValueError("the tokenizer's chat template ignores `tools`: the prompt would not list them")
    return tokenizer(text, add_special_tokens=False).input_ids


class ObservationEncoder:
    """Token ids of observation messages as the chat template wraps them after an assistant
    turn that ended in EOS, up to and including the next assistant header (module docstring)."""

    _BASE = ({"role": "user", "content": "?"}, {"role": "assistant", "content": "ok"})

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        closed = self._render(list(self._BASE), generation_prompt=False)
        anchor = self._BASE[1]["content"] + tokenizer.eos_token
        if anchor not in closed:
            raise ValueError(f"the chat template does not end an assistant turn with the EOS token: {closed!r}")
        self._prefix = closed[: closed.rindex(anchor) + len(anchor)]
        self._prefix_ids = self._ids(self._prefix)
        if self._prefix_ids[-1] != tokenizer.eos_token_id:
            raise ValueError("the EOS text does not tokenize to the EOS token")

    def encode(self, messages: Sequence[Message]) -> list[int]:
        full = self._render([*self._BASE, *messages], generation_prompt=True)
        if not full.startswith(self._prefix):
            raise ValueError("the chat template renders an assistant turn differently once messages follow it")
        ids = self._ids(full[len(self._prefix) :])
        if self._prefix_ids + ids != self._ids(full):
            raise ValueError(
                "the observation's tokens depend on the text before it: the tokenizer merges across the EOS"
            )
        return ids

    def _render(self, messages: list, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids


@dataclasses.dataclass(frozen=True)
class EpisodeCounts:
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    observation_tokens: int = 0
    sampled_tokens: int = 0
    env_seconds: float = 0.0
    """Wall-clock time of the environment's steps (tool calls) of this episode."""


@dataclasses.dataclass(frozen=True)
class Span:
    """Tokens [start, stop) of an episode: one assistant turn (sampled) or what preceded it."""

    start: int
    stop: int
    sampled: bool


@dataclasses.dataclass(frozen=True)
class EpisodeResult:
    """One finished episode as flat per-position arrays (prediction-aligned, length L)."""

    tokens: torch.Tensor
    """[L] int64: prompt, turns and observations."""
    loss_mask: torch.Tensor
    """[L] bool: position t predicts a sampled token (t + 1); 0 on prompt and observations."""
    old_logprobs: torch.Tensor
    """[L] float32: vLLM's logprob of token t + 1 where it was sampled, else 0."""
    versions: torch.Tensor
    """[L] int64: the policy version that sampled token t + 1, else NOT_SAMPLED."""
    routes: Optional[torch.Tensor]
    """[L - 1, layers, top_k] int16, input-aligned like ``Sample.routes``; None if not recorded."""
    spans: tuple[Span, ...]
    prompt_length: int
    reward: Optional[float]
    """The environment's reward; None when a limit ended the episode (``truncated``): the
    trainer's policy for those (score 0, or mask them out) is its own."""
    end: str
    """One of ENDS."""
    counts: EpisodeCounts

    @property
    def truncated(self) -> bool:
        return self.end != "done"


class Episode:
    """A growing episode: the token sequence the next turn is generated from, and what each
    token is. Owned by one driver; ``state`` is the environment's state of the episode."""

    def __init__(self, prompt_ids: Sequence[int], state: Any = None):
        if not prompt_ids:
            raise ValueError("an episode needs a non-empty prompt")
        self.tokens = [int(t) for t in prompt_ids]
        self.state = state
        self.prompt_length = len(self.tokens)
        self._logprobs = [0.0] * len(self.tokens)  # token-aligned until result()
        self._versions = [NOT_SAMPLED] * len(self.tokens)
        self._spans: list[Span] = [Span(0, len(self.tokens), False)]
        self._routes: Optional[torch.Tensor] = None
        self.counts = EpisodeCounts()
        self.last_turn: list[int] = []
        self.reward: Optional[float] = None
        self.end: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.end is not None

    def add_turn(self, sample: Sample, version: int) -> None:
        """Append one assistant turn as sampled; ``sample`` must continue this exact sequence."""
        if list(sample.prompt_ids) != self.tokens:
            raise ValueError("the sample was generated from another token sequence than this episode's")
        if len(sample.logprobs) != len(sample.token_ids):
            raise ValueError("an episode turn needs the logprob of every sampled token (Sampling.logprobs)")
        versions = sample.versions if sample.versions is not None else [version] * len(sample.token_ids)
        self._append(sample.token_ids, sample.logprobs, versions, sampled=True)
        self._routes = _merge_routes(self._routes, sample.routes)
        self.last_turn = list(sample.token_ids)
        self.counts = _add(self.counts, turns=1, sampled_tokens=len(sample.token_ids))

    def add_step(self, step: Step, observation_ids: Sequence[int] = (), seconds: float = 0.0) -> None:
        """Count the environment's answer (``seconds``: how long it took) and append its
        observation's tokens (if any)."""
        self.counts = _add(
            self.counts,
            env_seconds=seconds,
            tool_calls=step.tool_calls,
            tool_errors=step.tool_errors,
            tool_timeouts=step.tool_timeouts,
            observation_tokens=len(observation_ids),
        )
        if observation_ids:
            self._append(observation_ids, [0.0] * len(observation_ids), [NOT_SAMPLED] * len(observation_ids), False)

    def finish(self, reward: float) -> None:
        self.reward, self.end = float(reward), "done"

    def stop(self, end: str) -> None:
        """End the episode at a limit (truncated)."""
        if end not in ENDS[1:]:
            raise ValueError(f"an episode stops at one of {ENDS[1:]}, not {end!r}")
        self.end = end

    def result(self) -> EpisodeResult:
        if self.end is None:
            raise ValueError("the episode is not finished")
        n = len(self.tokens)
        sampled = torch.zeros(n, dtype=torch.bool)
        for span in self._spans:
            sampled[span.start : span.stop] = span.sampled
        shift = lambda values, fill, dtype: torch.tensor([*values[1:], fill], dtype=dtype)  # noqa: E731
        return EpisodeResult(
            tokens=torch.tensor(self.tokens, dtype=torch.long),
            loss_mask=torch.cat([sampled[1:], torch.zeros(1, dtype=torch.bool)]),
            old_logprobs=shift(self._logprobs, 0.0, torch.float32),
            versions=shift(self._versions, NOT_SAMPLED, torch.long),
            routes=self._routes,
            spans=tuple(self._spans),
            prompt_length=self.prompt_length,
            reward=self.reward,
            end=self.end,
            counts=self.counts,
        )

    def _append(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int], sampled: bool) -> None:
        start = len(self.tokens)
        self.tokens += [int(t) for t in ids]
        self._logprobs += [float(x) for x in logprobs]
        self._versions += [int(v) for v in versions]
        last = self._spans[-1]
        if last.sampled == sampled:
            self._spans[-1] = Span(last.start, len(self.tokens), sampled)
        else:
            self._spans.append(Span(start, len(self.tokens), sampled))


def _add(counts: EpisodeCounts, **more: float) -> EpisodeCounts:
    return dataclasses.replace(counts, **{k: getattr(counts, k) + v for k, v in more.items()})


def _merge_routes(earlier: Optional[torch.Tensor], recorded: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This turn's routes, where it has none (-1: a prefix-cache hit on an earlier turn's
    tokens) the earlier turns'."""
    if recorded is None or earlier is None:
        return recorded if recorded is not None else earlier
    merged = recorded.clone()
    n = min(earlier.shape[0], merged.shape[0])
    merged[:n] = torch.where(merged[:n] >= 0, merged[:n], earlier[:n])
    return merged
