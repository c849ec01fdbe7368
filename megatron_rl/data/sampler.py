"""Deterministic epoch order with a resumable position.

Epoch ``e`` visits the dataset in a permutation fixed by ``(seed, e)``, so a run resumed
from ``state_dict()`` continues with exactly the prompts it would have seen, and two
runs with the same seed see the same prompts in the same order.
"""

from __future__ import annotations

import random
from typing import Any


class EpochSampler:
    """Yields dataset indices epoch after epoch; ``(epoch, index)`` is the whole state."""

    def __init__(self, num_items: int, *, seed: int, shuffle: bool = True):
        if num_items < 1:
            raise ValueError(f"num_items must be >= 1, got {num_items}")
        self.num_items = num_items
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0  # position inside the current epoch's order
        self._order_epoch = -1
        self._order: list[int] = []

    def order(self, epoch: int) -> list[int]:
        """The permutation of epoch ``epoch`` (the identity when not shuffling)."""
        if epoch != self._order_epoch:
            order = list(range(self.num_items))
            if self.shuffle:
                random.Random(f"epoch-sampler-{self.seed}-{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def take(self, count: int) -> list[tuple[int, int]]:
        """The next ``count`` ``(epoch, dataset index)`` pairs; crosses epoch boundaries."""
        taken = []
        for _ in range(count):
            taken.append((self.epoch, self.order(self.epoch)[self.index]))
            self.index += 1
            if self.index == self.num_items:
                self.epoch, self.index = self.epoch + 1, 0
        return taken

    @property
    def drawn(self) -> int:
        """Items handed out since the start of the run (epochs included): a resumed run
        continues this count exactly, so it shows a prompt repeated or skipped."""
        return self.epoch * self.num_items + self.index

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "num_items": self.num_items,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``; refuses a state saved for a different dataset or seed."""
        for key in ("seed", "num_items", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"data position was saved with {key}={state[key]!r} but this loader has "
                    f"{key}={getattr(self, key)!r}; resuming would replay a different order"
                )
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < self.num_items:
            raise ValueError(f"data position epoch={epoch}, index={index} is outside 0..{self.num_items - 1}")
        self.epoch, self.index = epoch, index
