"""Served scorers at work while the batch still generates: each group scored as it finishes.

A served scorer (a judge's engine in a process of its own, beside rank 0) would otherwise
wait for the whole batch, then the step would wait for it. Here the engine tells of each
group the step it finishes (rollout.types.OnGroup); the group is queued for a thread that
hands what has queued up, as one batch, to the served scorers, while vLLM goes on with the
rest. When the batch is whole, the groups not yet heard of (other replicas' groups, which
arrive with the gather) are scored too, and :meth:`WeightedReward.score_batch` combines the
served scorers' outputs with the local ones (rules, a colocated reward model), which need
every rank and run then.

The thread only waits on the scorers' worker processes (pipes), so it takes no core from
generation; the seconds of scoring that passed before generation ended are
``timing/reward_hidden_s``.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Optional

from megatron_rl.data import PromptBatch
from megatron_rl.rewards.scoring import Prescored, Responses, ScorerOutput, WeightedReward
from megatron_rl.rollout import Sample
from megatron_rl.rollout.types import OnGroup

Overlap = Callable[[PromptBatch], OnGroup]
"""Given a batch about to generate, what to tell of each of its groups as it finishes."""
MakeResponses = Callable[[list[Sample], list[str]], Responses]
"""What the scorers read of samples, given each one's reference answer (trainer.rollouts.responses_of)."""


class _Batch:
    """One generation batch's served scoring: the groups heard of, the thread scoring them."""

    def __init__(self, reward: WeightedReward, answers: list[str], make: MakeResponses):
        self.reward, self.answers, self.make = reward, answers, make
        self.pending: queue.Queue = queue.Queue()
        self.scored: dict[int, dict[str, list[float]]] = {}
        """Group index -> each served scorer's scores of it."""
        self.failures: dict[str, int] = {}
        self.intervals: list[tuple[float, float]] = []
        self.heard: set[int] = set()
        self.error: Optional[BaseException] = None
        self.thread: Optional[threading.Thread] = None
        if any(s.scorer is not None for s in reward.served):  # else a rank the scores come to
            self.thread = threading.Thread(target=self._work, name="served-scoring", daemon=True)
            self.thread.start()

    def group_done(self, index: int, samples: list[Sample]) -> None:
        if self.thread is not None:
            self.heard.add(index)
            self.pending.put((index, self.make(samples, [self.answers[index]] * len(samples))))

    def _work(self) -> None:
        done = False
        while not done:
            items = [self.pending.get()]
            while not self.pending.empty():
                items.append(self.pending.get())
            done = items[-1] is None
            items = [item for item in items if item is not None]
            if items and self.error is None:
                try:
                    self._score(items)
                except BaseException as exc:  # raised again by finish, on the trainer's thread
                    self.error = exc

    def _score(self, items: list[tuple[int, Responses]]) -> None:
        started = time.perf_counter()
        outputs = self.reward.score_served(Responses.joined([group for _, group in items]))
        cursor = 0
        for index, group in items:
            self.scored[index] = {name: out.scores[cursor : cursor + len(group)] for name, out in outputs.items()}
            cursor += len(group)
        for name, out in outputs.items():
            self.failures[name] = self.failures.get(name, 0) + out.failures
        self.intervals.append((started, time.perf_counter()))

    def finish(self, responses: Responses) -> Prescored:
        """Every group of the whole batch ``responses`` scored (those not heard of, now), the
        served outputs in its order."""
        generated = time.perf_counter()
        if self.thread is None:
            return Prescored({}, 0.0, 0.0)
        groups, n = len(self.answers), len(responses) // max(len(self.answers), 1)
        for index in range(groups):
            if index not in self.heard:
                self.pending.put((index, responses.part(index * n, (index + 1) * n)))
        self.pending.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
        outputs = {
            name: ScorerOutput([v for i in range(groups) for v in self.scored[i][name]], failures)
            for name, failures in self.failures.items()
        }
        busy = sum(end - start for start, end in self.intervals)
        hidden = sum(max(0.0, min(end, generated) - start) for start, end in self.intervals)
        return Prescored(outputs, busy, hidden)


class OverlappedScoring:
    """The run's reward with its served scorers started on each group as it finishes.

    :meth:`begin` is the :data:`Overlap` a lockstep draw calls with each new batch;
    :meth:`score_batch` then scores that batch, using what was scored while it generated.
    A batch that was not begun (rollouts generated ahead, T-PPO windows) is scored whole.
    """

    def __init__(self, reward: WeightedReward, make: MakeResponses):
        self.reward, self.make = reward, make
        self._batch: Optional[_Batch] = None

    def begin(self, prompts: PromptBatch) -> OnGroup:
        self._batch = _Batch(self.reward, list(prompts.answers), self.make)
        return self._batch.group_done

    def score_batch(self, responses: Responses) -> tuple[list[float], dict]:
        batch, self._batch = self._batch, None
        return self.reward.score_batch(responses, None if batch is None else batch.finish(responses))

    @property
    def scorers(self):
        return self.reward.scorers

    def close(self) -> None:
        self.reward.close()
