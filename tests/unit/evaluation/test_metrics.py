"""avg@n and unbiased pass@k against hand-computed values and an exact computation with
binomials (math.comb, fractions)."""

import itertools
import math
from fractions import Fraction

import pytest

from megatron_rl.evaluation import PromptResult, pass_at_k, set_metrics


def _exact(n, c, k):
    """1 - C(n-c, k) / C(n, k) in exact rationals (math.comb is 0 for k > n - c)."""
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def _by_enumeration(n, c, k):
    """The share of k-subsets of n samples (c of them correct) holding a correct one."""
    correct = set(range(c))
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(bool(correct & set(s)) for s in subsets), len(subsets))


@pytest.mark.parametrize(
    "n,c,k,want",
    [
        (4, 0, 1, 0.0),
        (4, 1, 1, 0.25),  # pass@1 is the share of correct samples
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 1, 4, 1.0),
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (8, 8, 3, 1.0),
    ],
)
def test_pass_at_k_hand_computed(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-15)


def test_pass_at_k_equals_the_exact_binomial_formula_and_the_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = _exact(n, c, k)
                assert exact == _by_enumeration(n, c, k)
                assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12), (n, c, k)


def test_pass_at_k_stays_finite_where_the_binomials_overflow_floats():
    n, c, k = 2000, 3, 1000  # C(2000, 1000) ~ 1e600
    assert math.comb(n, k) > 10**308
    assert pass_at_k(n, c, k) == pytest.approx(float(_exact(n, c, k)), rel=1e-12)


@pytest.mark.parametrize("n,c,k", [(4, 1, 5), (4, 1, 0), (4, 5, 1), (4, -1, 1)])
def test_pass_at_k_refuses_what_has_no_unbiased_estimate(n, c, k):
    with pytest.raises(ValueError, match="pass@|correct"):
        pass_at_k(n, c, k)


def test_set_metrics_by_hand():
    results = [
        PromptResult.from_samples(0, [1.0, 0.0, 0.0, 0.0], [4, 4, 6, 2], truncated=1),
        PromptResult.from_samples(1, [1.0, 1.0, 0.0, 0.0], [3, 3, 3, 3], truncated=0),
        PromptResult.from_samples(2, [0.0, 0.0, 0.0, 0.0], [12, 12, 12, 12], truncated=4),
    ]
    assert [(r.n, r.correct) for r in results] == [(4, 1), (4, 2), (4, 0)]
    got = set_metrics("held_out", results, pass_k=[1, 2, 4])
    assert got == pytest.approx(
        {
            "val/held_out/accuracy": 3 / 12,
            "val/held_out/pass@1": (1 / 4 + 2 / 4 + 0) / 3,
            "val/held_out/pass@2": (1 / 2 + 5 / 6 + 0) / 3,
            "val/held_out/pass@4": (1 + 1 + 0) / 3,
            "val/held_out/response_length": (16 + 12 + 48) / 12,
            "val/held_out/truncated": 5 / 12,
        }
    )


def test_partial_credit_counts_in_accuracy_not_in_pass_at_k():
    result = PromptResult.from_samples(0, [0.5, 0.5], [1, 1], truncated=0)
    assert result.correct == 0
    got = set_metrics("s", [result], pass_k=[1])
    assert got["val/s/accuracy"] == 0.5 and got["val/s/pass@1"] == 0.0


def test_records_round_trip():
    result = PromptResult.from_samples(7, [1.0, 0.0], [3, 5], truncated=1)
    assert PromptResult(**result.to_record()) == result
