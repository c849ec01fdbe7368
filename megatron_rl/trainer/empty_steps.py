"""Steps that train nothing, counted so that a run which has stopped learning says so.

With dynamic sampling a step keeps only groups whose rewards differ; when every group is
all right or all wrong (a task too easy or too hard, a broken verifier, a collapsed
policy) the step keeps none, the actor is not updated, and the next step samples from the
same policy. Without dynamic sampling such a step's group-relative advantages are all 0,
and the trainer skips its update the same way (``RLTrainer.has_learning_signal``). One
such step is chance; many in a row mean nothing will change, and the run would spend its
whole budget generating. Each empty step gets a warning line, and
``algorithm.max_empty_steps`` of them in a row end the run with one line and exit code 2.
"""

from __future__ import annotations

from typing import Optional


class EmptyStepGuard:
    """Counts the empty steps in a row (the count restarts with the process)."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"limit={limit} must be >= 1")
        self.limit = limit
        self.in_a_row = 0

    def observe(self, step: int, trained_rows: int) -> tuple[Optional[str], Optional[str]]:
        """Record ``step``; returns (warning line, stop line), each None when not due.

        A step with rows to train on resets the count; the ``limit``-th empty step in a row
        gives the stop line instead of a warning.
        """
        if trained_rows > 0:
            self.in_a_row = 0
            return None, None
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            return None, (
                f"{self.in_a_row} steps in a row (the last: step {step}) kept no trainable group, so the "
                f"actor has not changed since (algorithm.max_empty_steps={self.limit}); every group's rewards "
                "were equal: check the verifier and the task's difficulty for this model, or a collapsed policy"
            )
        return (
            f"warning: step {step} kept no trainable group (every group's rewards were equal, or dynamic sampling "
            f"left too few for one training batch): the actor was not updated; {self.in_a_row} "
            f"such step(s) in a row, the run stops at algorithm.max_empty_steps={self.limit}"
        ), None
