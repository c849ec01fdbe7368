"""Per-prompt sampling seeds: what a prompt's samples are does not depend on when or where
they were generated.

A vLLM engine's own generator advances with every request it serves, so after a resume
(a fresh engine) or with another number of replicas (another split of the prompts) the
same prompt gets other samples. Seeding each prompt from (run seed, epoch, dataset index)
instead makes a resumed run sample exactly what the uninterrupted run did, and a run on
any layout sample what the single-replica run does. vLLM gives the n samples of a request
seeded `s` the seeds s, s + 1, ..., s + n - 1, so prompt seeds are spaced `MAX_SAMPLES`
apart. A multi-turn episode draws one seed per turn (the episode driver samples turn t of
an episode seeded `s` with `s + t`), so a prompt's episodes take `max_turns` seeds each.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

MAX_SAMPLES = 4096
"""Samples per prompt the spacing of the seeds leaves room for."""


def prompt_seed(run_seed: int, epoch: int, dataset_index: int) -> int:
    """The seed of one prompt's first sample: a hash of the three, a multiple of MAX_SAMPLES."""
    digest = hashlib.blake2b(f"{run_seed}/{epoch}/{dataset_index}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") % (1 << 40)) * MAX_SAMPLES


def prompt_seeds(run_seed: int, epochs: Sequence[int], dataset_indices: Sequence[int], n: int) -> list[int]:
    """One seed per prompt (see `prompt_seed`); refuses more samples than the spacing allows."""
    if n > MAX_SAMPLES:
        raise ValueError(f"{n} samples per prompt exceed the {MAX_SAMPLES} that per-prompt seeds leave room for")
    if len(epochs) != len(dataset_indices):
        raise ValueError(f"{len(epochs)} epochs for {len(dataset_indices)} prompts")
    return [prompt_seed(run_seed, e, i) for e, i in zip(epochs, dataset_indices)]


def episode_seeds(
    run_seed: int, epochs: Sequence[int], dataset_indices: Sequence[int], n: int, max_turns: int
) -> list[int]:
    """The seeds of ``n`` episodes per prompt, prompt by prompt: episode j of a prompt seeded
    ``s`` (`prompt_seed`) starts at ``s + j * max_turns``, its turns taking the seeds up to the next.
    Refuses more seeds per prompt than the spacing allows."""
    if n * max_turns > MAX_SAMPLES:
        raise ValueError(
            f"{n} episodes of up to {max_turns} turns per prompt exceed the {MAX_SAMPLES} seeds per prompt"
        )
    return [s + j * max_turns for s in prompt_seeds(run_seed, epochs, dataset_indices, 1) for j in range(n)]
