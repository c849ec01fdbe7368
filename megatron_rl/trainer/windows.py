"""T-PPO's successive batching: the pool of in-flight responses carried across steps.

Each step generates at most ``generation_window`` new tokens per response. A response the
window cut off ("window") stays in the pool and is continued next step by the updated
policy; a finished one is scored, trained on once more (its last window) and leaves,
and its slot goes to new prompts (``group_size`` responses each) so the pool stays full
(``capacity`` rows, exceeded by less than one group when the free rows are not a whole
number of groups).

The policy loss of a row covers only the response tokens no earlier loss has seen
(``trained`` onwards): earlier windows and the prompt are context. Without training in
flight (the recipe's ``train_in_flight`` False, an ablation of the paper's design) only
finished responses are trained, each whole and once, with its outcome. Rows that do not fit
this step's even split over DP x micro-batches x mini-batches stay in the pool untouched
and are trained next step. Everything here is pure bookkeeping on lists that are
identical on every rank (the rollouts are all-gathered), so every rank takes the same
decisions without communicating; the state is JSON-like for the checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from megatron_rl.from_config.rows import check_window_pool
from megatron_rl.rollout.types import Sample


@dataclasses.dataclass
class WindowSample:
    """One response in flight (or finished and not yet trained) with its bookkeeping."""

    sample: Sample
    """Prompt, every response token so far with its vLLM logprob, finish reason."""
    answer: str
    prompt_key: int
    """Which prompt it answers (a running counter: the responses of one prompt share it)."""
    trained: int = 0
    """Response tokens already in a policy loss; the next loss starts here."""
    fresh: int = 0
    """Response tokens that existed before this step's generation (the rest were sampled
    by the current weights: the train/inference mismatch is measured on them)."""
    windows: int = 0
    """Generation calls that extended this response."""
    correct: Optional[float] = None
    """Verifier score, set once the response finished."""
    reward: Optional[float] = None
    """Score plus shaping (overlong penalty), set with ``correct``."""

    @property
    def finished(self) -> bool:
        return self.sample.finished

    @property
    def length(self) -> int:
        return len(self.sample.token_ids)

    def to_state(self) -> dict:
        """JSON-able state. MoE routes are left out: the continuation after a resume prefills
        the whole sequence again, and vLLM records the routes of every position anew."""
        sample = {f.name: getattr(self.sample, f.name) for f in dataclasses.fields(self.sample) if f.name != "routes"}
        return {
            **sample,
            "answer": self.answer,
            "prompt_key": self.prompt_key,
            "trained": self.trained,
            "fresh": self.fresh,
            "windows": self.windows,
            "correct": self.correct,
            "reward": self.reward,
        }

    @classmethod
    def from_state(cls, state: dict) -> "WindowSample":
        sample = Sample(
            prompt_ids=list(state["prompt_ids"]),
            token_ids=list(state["token_ids"]),
            logprobs=list(state["logprobs"]),
            finish_reason=state["finish_reason"],
        )
        return cls(
            sample,
            state["answer"],
            int(state["prompt_key"]),
            trained=int(state["trained"]),
            fresh=int(state["fresh"]),
            windows=int(state["windows"]),
            correct=state["correct"],
            reward=state["reward"],
        )


@dataclasses.dataclass(frozen=True)
class StepCounts:
    """What one step did to the pool (metrics)."""

    carried: int
    """Unfinished responses of earlier steps continued this step."""
    new_prompts: int
    finished: int
    """Responses that finished during this step's generation."""


class WindowPool:
    """The responses of a T-PPO run that have not left training yet, oldest first."""

    def __init__(self, capacity: int, group_size: int, row_multiple: int, train_in_flight: bool = True):
        check_window_pool(capacity, group_size, row_multiple)
        self.train_in_flight = train_in_flight
        self.capacity = capacity
        self.group_size = group_size
        self.row_multiple = row_multiple
        self.samples: list[WindowSample] = []
        self.next_prompt_key = 0

    # -- one step, in order -------------------------------------------------------------

    def begin_step(self) -> list[Sample]:
        """Mark what exists before generation; the unfinished responses to continue, in pool order."""
        for s in self.samples:
            s.fresh = s.length
        return [s.sample for s in self.samples if not s.finished]

    def new_prompt_count(self) -> int:
        """Groups that fill the free rows; the last may overfill by < group_size rows, so
        that the pool always holds at least one trainable batch (``capacity >= row_multiple``)."""
        return -(-max(self.capacity - len(self.samples), 0) // self.group_size)

    def continued(self, samples: Sequence[Sample]) -> None:
        """Take the continuations of :meth:`begin_step`'s list (same order)."""
        todo = [s for s in self.samples if not s.finished]
        if len(samples) != len(todo):
            raise ValueError(f"{len(samples)} continuations for {len(todo)} unfinished responses")
        for entry, sample in zip(todo, samples):
            if sample.token_ids[: entry.length] != entry.sample.token_ids:
                raise ValueError("a continuation does not extend its response")
            entry.sample = sample
            entry.windows += 1

    def add_group(self, answer: str, samples: Sequence[Sample]) -> None:
        """One new prompt's responses (their first window)."""
        key = self.next_prompt_key
        self.next_prompt_key += 1
        self.samples += [WindowSample(s, answer, key, windows=1) for s in samples]

    def to_score(self) -> list[WindowSample]:
        """Finished responses without a score yet (the ones that finished this step)."""
        return [s for s in self.samples if s.finished and s.correct is None]

    def set_scores(self, entries: Sequence[WindowSample], correct: Sequence[float], rewards: Sequence[float]) -> None:
        for entry, c, r in zip(entries, correct, rewards, strict=True):
            entry.correct, entry.reward = float(c), float(r)

    def training_rows(self) -> list[WindowSample]:
        """The oldest rows that split evenly; the rest wait in the pool for the next step."""
        ready = self.samples if self.train_in_flight else [s for s in self.samples if s.finished]
        usable = len(ready) - len(ready) % self.row_multiple
        return ready[:usable]

    def trained(self, rows: Sequence[WindowSample]) -> None:
        """After the update: finished rows leave, unfinished ones keep their tokens as context."""
        done = {id(r) for r in rows}
        for r in rows:
            r.trained = r.length
        self.samples = [s for s in self.samples if not (id(s) in done and s.finished)]

    # -- checkpoint ---------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "samples": [s.to_state() for s in self.samples],
            "next_prompt_key": self.next_prompt_key,
            "capacity": self.capacity,
            "group_size": self.group_size,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume the pool; a different capacity or group size is refused (the batch would change shape)."""
        for key in ("capacity", "group_size"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"the checkpoint's window pool has {key}={state[key]} but this run has "
                    f"{key}={getattr(self, key)}; keep rollout.prompts_per_step and "
                    "rollout.n_samples when resuming a T-PPO run"
                )
        self.samples = [WindowSample.from_state(s) for s in state["samples"]]
        self.next_prompt_key = int(state["next_prompt_key"])
