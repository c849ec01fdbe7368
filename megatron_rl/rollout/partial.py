"""Partial rollouts: a generation in flight when new weights arrive is continued under them.

With ``rollout.partial`` the rollout ranks generate a batch ``chunk_tokens`` new tokens per
sample at a time: the first chunk as any generation (``generate_groups`` with the chunk
as its window), each further one as T-PPO continues a window (``continue_samples``: the
prompt and the tokens so far prefilled again, at most one more chunk sampled). Between two
chunks the server runs the weight update waiting for it, if any
(:class:`megatron_rl.rollout.server.RolloutServer`), so the rest of the batch samples the new
policy. Loading new weights drops vLLM's prefix cache, so a continued sample's prefix is
prefilled again under the new weights: its later tokens are exactly what the new policy
samples after that prefix.

Every response token keeps the policy version that sampled it (``Sample.versions``,
non-decreasing along a response). A sample's staleness is the trainer's version minus its
oldest token's, and its *fresh* tokens (the train/inference mismatch is measured on them)
are those of the trainer's current version. The loss needs nothing else: each token's
behaviour logprob is vLLM's under the version that sampled it, which is what the rollout
correction reweights by. Everything here but :func:`generate_in_chunks` is bookkeeping on
lists, the same on every rank.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from megatron_rl.rollout.types import Sample, Sampling

if TYPE_CHECKING:
    from megatron_rl.data import PromptBatch
    from megatron_rl.rollout.replicas import Replicas


def with_versions(before: Optional[Sample], after: Sample, version: int) -> Sample:
    """``after`` (``before`` extended; None: a new sample) with its new tokens stamped ``version``."""
    old = [] if before is None else before.token_ids
    if after.token_ids[: len(old)] != old:
        raise ValueError("a continuation does not extend its sample")
    earlier = [] if before is None else list(before.versions or [])
    if len(earlier) != len(old):
        raise ValueError(f"{len(earlier)} versions for {len(old)} response tokens")
    return dataclasses.replace(after, versions=earlier + [version] * (len(after.token_ids) - len(old)))


def oldest_version(samples: Sequence[Sample]) -> Optional[int]:
    """The oldest version any token of ``samples`` was sampled with (None: none recorded)."""
    firsts = [s.versions[0] for s in samples if s.versions]
    return min(firsts) if firsts else None


def spans_versions(sample: Sample) -> bool:
    """Whether ``sample``'s tokens were sampled by more than one policy version."""
    return bool(sample.versions) and sample.versions[0] != sample.versions[-1]


def fresh_start(sample: Sample, version: int) -> int:
    """Response tokens sampled before policy ``version`` (the rest are fresh: sampled by it)."""
    return sum(v < version for v in sample.versions or [])


def generate_in_chunks(
    replicas: Replicas,
    prompts: PromptBatch,
    sampling: Sampling,
    chunk_tokens: int,
    version: int,
    between_chunks: Callable[[], int],
) -> list[list[Sample]]:
    """``sampling.n`` samples per prompt (as ``generate_groups``), ``chunk_tokens`` at a
    time; ``between_chunks`` runs what must run before the next chunk (new weights) and
    returns the policy version the next chunk samples. Collective over the replicas' world."""
    chunked = dataclasses.replace(sampling, window=chunk_tokens)
    groups = replicas.generate_groups(prompts, chunked)
    sizes = [len(g) for g in groups]
    flat = [with_versions(None, s, version) for g in groups for s in g]
    while not all(s.finished for s in flat):
        version = between_chunks()
        continued = replicas.continue_samples(flat, chunked)
        flat = [s if s.finished else with_versions(s, c, version) for s, c in zip(flat, continued, strict=True)]
    out, start = [], 0
    for size in sizes:
        out.append(flat[start : start + size])
        start += size
    return out
