"""The phases of a live RLTrainer's steps, timed where they run, and what they ran on.

:class:`PhaseClock` replaces some of a trainer's bound methods (and of its rollout source and
engine) on the instance with timed wrappers: each call adds its seconds to the current step's
phase, and the wrappers of :data:`CAPTURED` keep their arguments, so the floors
(:mod:`.step_floors`) can run the same requests and batches after the run. The trainer's own
code is untouched; the clock only listens.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

TRAINER_PHASES = {
    "critic_values": "critic_values",
    "old_logprobs": "old_logprobs",
    "rollout_correction": "rollout_correction",
    "reference_logprobs": "reference_logprobs",
    "teacher_logprobs": "teacher_logprobs",
    "advantages": "advantages",
    "distill": "distill",
    "save_rollouts": "save_rollouts",
    "update": "update",
    "sync_weights": "weight_sync",
    "evaluate": "eval",
    "checkpoint": "checkpoint",
}
"""RLTrainer method -> phase. What RLTrainer.step does outside these (assembling the batch,
the step's metrics, logging) is the overhead row."""


@dataclasses.dataclass
class StepRecord:
    """One step: seconds per phase, the step's own seconds, and what the floors replay."""

    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    step_s: float = 0.0
    generate_calls: list[tuple] = dataclasses.field(default_factory=list)
    """(requests, params) of each vLLM generate the engine made this step (params cloned
    before vLLM sees them: it fills in fields of the ones it is given)."""
    generated_tokens: int = 0
    """Tokens those calls generated."""
    update_batch: object = None
    """The StepBatch the update trained on."""


def vllm_engine(trainer):
    """This rank's RolloutEngine (colocated: inside the trainer's Replicas), or None."""
    replicas = trainer.engine
    return getattr(replicas, "engine", replicas)


class PhaseClock:
    """Times a trainer's phases per step (install once, before ``trainer.run()``)."""

    def __init__(self):
        self.steps: list[StepRecord] = []
        self.active: list[str] = []
        """The phases running now, outermost first (generation counts inside the rollout only:
        the eval phase generates too, and its requests are the eval's, not the step's)."""

    @property
    def current(self) -> StepRecord:
        return self.steps[-1]

    def install(self, trainer) -> None:
        self._wrap(trainer, "step", self._timed_step)
        for method, phase in TRAINER_PHASES.items():
            self._wrap(trainer, method, self._timed(phase))
        self._wrap(trainer, "update", self._capturing_update)  # around the timed update
        self._wrap(trainer.source, "collect", self._timed("rollout"))
        engine = vllm_engine(trainer)
        if engine is not None:
            self._wrap(engine, "generate", self._timed("generation", inside="rollout"))
            self._wrap(engine, "_generate", self._capturing_generate)

    @staticmethod
    def _wrap(owner, name: str, make: Callable) -> None:
        """``owner.name`` becomes ``make(owner.name)`` on the instance (the class keeps its own)."""
        setattr(owner, name, make(getattr(owner, name)))

    def _timed_step(self, original):
        def timed(step):
            self.steps.append(StepRecord())
            started = time.perf_counter()
            try:
                return original(step)
            finally:
                self.current.step_s = time.perf_counter() - started

        return timed

    def _timed(self, phase: str, inside: Optional[str] = None):
        """Calls add their seconds to ``phase`` (only while ``inside`` runs, if given)."""

        def make(original):
            def timed(*args, **kwargs):
                counted = bool(self.steps) and (inside is None or inside in self.active)
                started = time.perf_counter()
                self.active.append(phase)
                try:
                    return original(*args, **kwargs)
                finally:
                    self.active.pop()
                    if counted:
                        phases = self.current.phases
                        phases[phase] = phases.get(phase, 0.0) + time.perf_counter() - started

            return timed

        return make

    def _capturing_update(self, timed_update):
        def update(step, batch, metrics):
            self.current.update_batch = batch
            return timed_update(step, batch, metrics)

        return update

    def _capturing_generate(self, original):
        def generate(requests, params, on_output=None):
            if not self.steps or "rollout" not in self.active:
                return original(requests, params, on_output)
            self.current.generate_calls.append((list(requests), [p.clone() for p in params]))
            outputs = original(requests, params, on_output)
            self.current.generated_tokens += generated_tokens(outputs)
            return outputs

        return generate


def generated_tokens(outputs) -> int:
    """Tokens in vLLM's RequestOutputs (every completion of every request)."""
    return sum(len(c.token_ids) for out in outputs for c in out.outputs)
