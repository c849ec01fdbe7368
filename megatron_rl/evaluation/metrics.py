"""Held-out evaluation metrics: avg@n accuracy and the unbiased pass@k, per eval set.

Each prompt of a set gets ``n`` samples; a sample scores the task reward's value for it
(0..1) and counts as correct when that value is the full reward. Per set:

- ``val/<set>/accuracy``: the mean score over all samples (avg@n; for 0/1 rewards, the
  share of correct samples),
- ``val/<set>/pass@<k>``: the mean over prompts of the unbiased estimator of Chen et al.
  2021, 1 - C(n - c, k) / C(n, k) for a prompt with c correct of n samples,
- ``val/<set>/response_length``: mean response tokens per sample,
- ``val/<set>/truncated``: the share of samples cut off by the token budget.

Pure Python (no torch), so the numbers can be recomputed from the per-prompt records.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

CORRECT_SCORE = 1.0
"""A sample counts toward pass@k when its score reaches the full reward (partial credit,
as some verifiers give, adds to the accuracy but passes nothing)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct of ``n`` samples (Chen et al. 2021):
    the chance that ``k`` of the ``n`` samples drawn without replacement hold a correct one.

    1 - C(n - c, k) / C(n, k) is computed as 1 - prod_{i = n - c + 1}^{n} (1 - k / i), which
    never forms the binomials (they overflow floats for n in the hundreds). Defined for
    1 <= k <= n: with fewer samples than k there is no unbiased estimate, so k > n raises
    (the eval config refuses ``pass_k`` above ``n_samples`` before a run starts)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= correct <= n, got correct={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n={n} samples per prompt")
    if n - c < k:  # every draw of k samples holds a correct one
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptResult:
    """One prompt's samples, summed up (a line of ``eval/step_<N>.jsonl``)."""

    prompt_id: int
    """The prompt's index in its eval set (stable for a set's source and size)."""
    n: int
    """Samples drawn."""
    correct: int
    """Samples with the full reward."""
    mean_score: float
    """Mean reward over the samples."""
    mean_length: float
    """Mean response tokens."""
    truncated: int
    """Samples cut off by the token budget."""

    @classmethod
    def from_samples(cls, prompt_id: int, scores: Sequence[float], lengths: Sequence[int], truncated: int):
        if not scores or len(scores) != len(lengths):
            raise ValueError(f"prompt {prompt_id}: {len(scores)} scores for {len(lengths)} responses")
        return cls(
            prompt_id=prompt_id,
            n=len(scores),
            correct=sum(s >= CORRECT_SCORE for s in scores),
            mean_score=sum(scores) / len(scores),
            mean_length=sum(lengths) / len(lengths),
            truncated=truncated,
        )

    def to_record(self) -> dict:
        return dataclasses.asdict(self)


def set_metrics(name: str, results: Sequence[PromptResult], pass_k: Sequence[int]) -> dict[str, float]:
    """The ``val/<name>/...`` metrics of one eval set from its prompts' results."""
    if not results:
        raise ValueError(f"eval set {name!r} has no results")
    samples = sum(r.n for r in results)
    metrics = {
        f"val/{name}/accuracy": sum(r.mean_score * r.n for r in results) / samples,
        f"val/{name}/response_length": sum(r.mean_length * r.n for r in results) / samples,
        f"val/{name}/truncated": sum(r.truncated for r in results) / samples,
    }
    for k in pass_k:
        metrics[f"val/{name}/pass@{k}"] = sum(pass_at_k(r.n, r.correct, k) for r in results) / len(results)
    return metrics
