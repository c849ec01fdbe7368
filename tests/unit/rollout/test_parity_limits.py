"""The parity guard's logprob limits: statistics and verdicts against hand-computed values."""

import pytest
import torch

from megatron_rl.rollout.parity import (
    PARITY_LIMITS,
    ParityError,
    ParityLimits,
    ParityReport,
    judge,
    parity_limits,
    parity_report,
)


def test_report_statistics_by_hand():
    diffs = torch.tensor([0.01, 0.0, 0.5, 0.02, 0.03], dtype=torch.float64)
    report = parity_report(diffs)  # one process: this rank's values
    assert report.tokens == 5
    assert report.mean_abs_diff == pytest.approx(0.112, abs=1e-12)
    assert report.max_abs_diff == pytest.approx(0.5, abs=1e-12)
    assert report.median_abs_diff == pytest.approx(0.02, abs=1e-12)


def test_limits_name_each_statistic_above_its_limit():
    report = ParityReport(mean_abs_diff=0.2, max_abs_diff=0.9, tokens=10, median_abs_diff=0.05)
    assert ParityLimits(median=0.03).exceeded(report) == ["median 0.05 > 0.03"]
    assert ParityLimits(mean=0.1, max=1.0).exceeded(report) == ["mean 0.2 > 0.1"]
    assert ParityLimits().exceeded(report) == []


def test_bf16_noise_passes_and_a_wrong_weight_fails_by_the_median():
    """A bf16 sync's typical report (median 0.008, a few near-tie tokens at 0.08) passes the
    bf16 limits and would fail fp32's; a wrong weight's (median 0.7) fails both."""
    noise = ParityReport(mean_abs_diff=0.011, max_abs_diff=0.08, tokens=120, median_abs_diff=0.008)
    wrong = ParityReport(mean_abs_diff=0.9, max_abs_diff=4.0, tokens=120, median_abs_diff=0.7)
    assert judge(noise, parity_limits("bfloat16"), "bfloat16") is noise
    with pytest.raises(ParityError, match=r"max 0.08 > 0.001.*a weight is missing or wrongly mapped"):
        judge(noise, parity_limits("float32"), "float32")
    for dtype in ("bfloat16", "float32"):
        with pytest.raises(ParityError, match="wrongly mapped"):
            judge(wrong, parity_limits(dtype), dtype)


def test_parity_threshold_sets_the_limit_on_the_maximum():
    assert parity_limits("float32", 1e-5) == ParityLimits(mean=1e-4, max=1e-5)
    assert parity_limits("bfloat16", 0.2) == ParityLimits(median=0.03, max=0.2)
    assert set(PARITY_LIMITS) == {"float32", "bfloat16", "float16"}
