"""Rollouts that run ahead of training (``rollout.max_staleness: k > 0``, disaggregated).

The rollout ranks run their commands in the order sent (:mod:`megatron_rl.rollout.server`).
:class:`AheadGeneration` keeps ``k`` generation batches submitted and not yet trained on:
when a step takes a batch, it submits the next one at once, before the step trains, so the
rollout ranks generate it while the training ranks update. That batch samples with the
weights the rollout ranks had when it was submitted; the update's weights are sent after
it and reach the engines once it is done. A batch taken at step s was submitted during
step s - j (j <= k) and samples policy version ``version - j``: its staleness is at most k
by construction, and a batch found staler (it cannot happen unless the order of commands
changes) is dropped, counted in ``rollout/dropped_stale``, and drawn again.

Resume: the data position saved with a checkpoint is the loader's position before the
prompts still in flight were drawn, so a resumed run draws them again (generated then by
the resumed weights): no prompt is lost or trained twice. ``data/prompts_drawn`` counts
the same way (prompts of batches taken).

What a batch is depends on the source: :class:`GroupRequests` asks for G samples per
prompt (``Generate``), the episode source for G multi-turn episodes per prompt run to their
ends on the rollout ranks (``GenerateEpisodes``, :mod:`megatron_rl.trainer.episodes`); the
queue, the versions and the data position are the same for both.

Partial rollouts (``chunk_tokens``, :mod:`megatron_rl.rollout.partial`): a batch still
generating when the update's weights arrive continues under them, so its later tokens are
fresher; its oldest tokens are still those of the version it was submitted at, and the
staleness bound is judged on them.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Optional, Protocol

from megatron_rl.data import PromptBatch, PromptLoader
from megatron_rl.rollout import Sampling
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.commands import Command, Generate
from megatron_rl.rollout.partial import oldest_version
from megatron_rl.trainer.rollouts import Drawn


class Requests(Protocol):
    """What one batch asks the rollout ranks for, and what their answer is as a draw."""

    def command(self, prompts: PromptBatch, sampling: Sampling) -> object:
        """The command that generates ``prompts``' batch: one of rollout's, or one the client
        was told of (``extra_commands``: the episode source's ``GenerateEpisodes``)."""
        ...

    def drawn(self, prompts: PromptBatch, answer: Any) -> Drawn:
        """The batch as a draw, from the command's answer (which carries ``seconds`` and
        ``idle_s``: :class:`~megatron_rl.rollout.commands.Generation`)."""
        ...


@dataclasses.dataclass(frozen=True)
class GroupRequests:
    """G samples per prompt (``sampling.n``), whole or in partial chunks."""

    chunk_tokens: Optional[int] = None
    """Partial rollouts: tokens per sample between two looks for new weights (None: off)."""

    def command(self, prompts: PromptBatch, sampling: Sampling) -> Command:
        return Generate(prompts, sampling, self.chunk_tokens)

    def drawn(self, prompts: PromptBatch, answer: Any) -> Drawn:
        return Drawn(prompts, answer.groups)


@dataclasses.dataclass
class InFlight:
    """A generation batch submitted and not taken yet."""

    number: int
    """The client's command number (its answer is asked for by it)."""
    prompts: PromptBatch
    version: int
    """Policy version at submission: what the batch samples with."""
    loader_state: dict
    """The loader's position before these prompts were drawn."""
    prompts_drawn: int
    """The loader's count of prompts at that position."""


class AheadGeneration:
    """Up to ``depth`` generation batches in flight on the rollout ranks (every training rank
    keeps the same queue; only training rank 0 sends and receives). ``depth`` 0: each batch
    is submitted when it is needed and waited for (synchronous, the colocated run's rows)."""

    def __init__(self, client: RolloutClient, loader: PromptLoader, depth: int, requests: Requests = GroupRequests()):
        if depth < 0:
            raise ValueError(f"rollouts run ahead by >= 0 batches, not {depth}")
        self.client, self.loader, self.depth, self.requests = client, loader, depth, requests
        self.queue: collections.deque[InFlight] = collections.deque()
        self.step_times = StepTimes()

    def draw(self, sampling: Sampling, overlap=None) -> Drawn:
        """The oldest batch in flight (submitted now if none is), with the queue topped up
        again before returning; a batch staler than ``depth`` versions is dropped and redrawn.
        ``overlap`` is not called: the batch was generated before (it is scored whole)."""
        while True:
            if not self.queue:
                self._submit(sampling)
            entry = self.queue.popleft()
            waited = time.perf_counter()
            answer = self.client.result(entry.number)
            self.step_times.took(answer, time.perf_counter() - waited)
            self._top_up(sampling)
            drawn = self.requests.drawn(entry.prompts, answer)
            oldest = oldest_version([s for g in drawn.samples for s in g])
            version = entry.version if oldest is None else oldest
            if self.client.version - version <= self.depth:
                return dataclasses.replace(drawn, version=version)
            self.step_times.dropped_stale += len(entry.prompts)

    def _top_up(self, sampling: Sampling) -> None:
        while len(self.queue) < self.depth:
            self._submit(sampling)

    def _submit(self, sampling: Sampling) -> None:
        state, drawn = self.loader.state_dict(), self.loader.prompts_drawn
        prompts = self.loader.next_batch()
        number = self.client.submit(self.requests.command(prompts, sampling))
        self.queue.append(InFlight(number, prompts, self.client.version, state, drawn))

    @property
    def version(self) -> int:
        """The policy version the training ranks hold (weight updates sent so far)."""
        return self.client.version

    # -- the data position (checkpoint and metrics) ----------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The loader's position before the oldest batch in flight was drawn."""
        return self.queue[0].loader_state if self.queue else self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.queue:
            raise RuntimeError("a data position is loaded before any batch is in flight")
        self.loader.load_state_dict(state)

    @property
    def prompts_drawn(self) -> int:
        """Prompts of the batches taken so far (those in flight are not counted)."""
        return self.queue[0].prompts_drawn if self.queue else self.loader.prompts_drawn


@dataclasses.dataclass
class StepTimes:
    """What the batches taken in one step cost on either side (reset by :meth:`metrics`)."""

    generation_s: float = 0.0
    """Time the rollout ranks spent generating them."""
    train_idle_s: float = 0.0
    """Time the training ranks waited for them."""
    rollout_idle_s: float = 0.0
    """Time the rollout ranks waited for their commands."""
    hidden_s: float = 0.0
    """Generation time the training ranks did not wait for, batch by batch: a batch that ran
    ahead hides part of its generation behind training; a refill drawn on the spot hides
    none, and the latency of its answer must not count against the batch that ran ahead."""
    dropped_stale: int = 0

    def took(self, generation, waited_s: float) -> None:
        self.generation_s += generation.seconds
        self.train_idle_s += waited_s
        self.rollout_idle_s += generation.idle_s
        self.hidden_s += max(generation.seconds - waited_s, 0.0)

    def metrics(self) -> dict:
        out = {
            "timing/generation_s": self.generation_s,
            "timing/train_idle_s": self.train_idle_s,
            "timing/rollout_idle_s": self.rollout_idle_s,
            "timing/generation_hidden_s": self.hidden_s,
            "rollout/dropped_stale": self.dropped_stale,
        }
        self.generation_s = self.train_idle_s = self.rollout_idle_s = self.hidden_s = 0.0
        self.dropped_stale = 0
        return out
