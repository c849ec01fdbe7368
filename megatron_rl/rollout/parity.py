"""The parity guard's logprob half: vLLM's logprobs against Megatron's, judged per dtype.

After a weight sync, vLLM and Megatron hold the same weights but compute with different
kernels (fused vs unfused attention, GEMM blocking, the order of the top-k expert sum).
In float32 the difference is rounding noise, ~1e-6 per token, so any sizeable gap means
a weight is missing or wrongly mapped. In bfloat16 each matmul rounds its output to 8
bits of mantissa: a token's logprob moves by ~1e-2 and a few tokens, where the two
kernels round a near-tie differently, by 0.05-0.1. A fixed threshold on the maximum
cannot separate the two cases in bf16, so the limits here depend on the dtype and use
the statistic that separates them: the maximum in fp32, the median in bf16/fp16 (a wrong
weight moves most tokens; rounding noise moves a few a lot). The guard's other half,
:mod:`megatron_rl.rollout.weight_check`, reads the synced weights back from vLLM and
catches a wrong weight in any dtype whatever the logprobs say.

The limits are measured on the tests' tiny models (docs/benchmarks.md, "bf16"):
fp32 max <= 2e-6, bf16 median 0.008, mean 0.011, max 0.08 on the tiny MoE; a scrambled
projection gives a bf16 median of 0.7.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist


class ParityError(RuntimeError):
    """vLLM's logprobs, or its weights, differ from Megatron's beyond the limits after a sync."""


@dataclasses.dataclass(frozen=True)
class ParityReport:
    """|logprob(vLLM) - logprob(Megatron)| over the compared tokens (worst rank's value)."""

    mean_abs_diff: float
    max_abs_diff: float
    tokens: int
    median_abs_diff: float = 0.0


@dataclasses.dataclass(frozen=True)
class ParityLimits:
    """Upper limits on a :class:`ParityReport`'s statistics (None: not judged)."""

    median: Optional[float] = None
    mean: Optional[float] = None
    max: Optional[float] = None

    def exceeded(self, report: ParityReport) -> list[str]:
        """``"median 0.72 > 0.03"`` for every statistic above its limit."""
        found = []
        for stat in ("median", "mean", "max"):
            limit, value = getattr(self, stat), getattr(report, f"{stat}_abs_diff")
            if limit is not None and value > limit:
                found.append(f"{stat} {value:.3g} > {limit:g}")
        return found


PARITY_LIMITS = {
    "float32": ParityLimits(mean=1e-4, max=1e-3),
    "bfloat16": ParityLimits(median=0.03),
    "float16": ParityLimits(median=0.03),
}
"""Default limits per engine dtype: ~50x the measured noise in fp32, ~4x in bf16 (whose
median noise is 0.008 and a wrong weight's 0.7). float16 keeps bf16's limits, unmeasured."""


def parity_limits(dtype: str, max_abs_diff: Optional[float] = None) -> ParityLimits:
    """The limits for an engine in ``dtype``; ``max_abs_diff`` (``rollout.parity_threshold``)
    adds a limit on the maximum, replacing the default one."""
    limits = PARITY_LIMITS[dtype]
    return limits if max_abs_diff is None else dataclasses.replace(limits, max=max_abs_diff)


def parity_report(diffs: torch.Tensor) -> ParityReport:
    """The statistics of this rank's per-token differences, reduced to the worst rank's
    (collective over the world group when it is initialized: each rank's engine is its own)."""
    diffs = diffs.to(torch.float64).flatten()
    stats = torch.tensor(
        [float(diffs.sum()), float(diffs.numel()), float(diffs.max()), float(diffs.median())], dtype=torch.float64
    )
    if dist.is_initialized():
        totals, worst = stats[:2].clone(), stats[2:].clone()
        dist.all_reduce(totals)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        stats = torch.cat([totals, worst])
    return ParityReport(float(stats[0] / stats[1]), float(stats[2]), int(stats[1]), float(stats[3]))


def judge(report: ParityReport, limits: ParityLimits, dtype: str) -> ParityReport:
    """Raise :class:`ParityError` when ``report`` exceeds ``limits``; else return it."""
    exceeded = limits.exceeded(report)
    if exceeded:
        raise ParityError(
            f"vLLM and Megatron logprobs differ after the weight sync ({', '.join(exceeded)}; mean "
            f"{report.mean_abs_diff:.3g}, median {report.median_abs_diff:.3g}, max {report.max_abs_diff:.3g} "
            f"over {report.tokens} tokens, {dtype}): a weight is missing or wrongly mapped"
        )
    return report
