"""The comparison harness's statistics on values worked out by hand: the Student-t interval
over seeds, Welch's interval for a difference, trailing means and the step a target is
reached at, best and last windows, and interpolation onto a time grid."""

import math

import pytest

from megatron_rl_lab.bench import seed_stats as st


def test_t_quantiles_come_from_the_table_then_the_normal():
    assert st.t_975(1) == 12.7062
    assert st.t_975(2) == 4.3027
    assert st.t_975(2.94) == 4.3027  # Welch's fractional df: rounded down
    assert st.t_975(30) == 2.0423
    assert st.t_975(31) == st.NORMAL_975 == 1.96
    with pytest.raises(ValueError, match="df >= 1"):
        st.t_975(0.5)


def test_mean_and_interval_over_seeds():
    one_two_three = st.mean_interval([1.0, 2.0, 3.0])  # sd 1
    assert one_two_three.mean == 2.0 and one_two_three.n == 3
    assert one_two_three.half_width == pytest.approx(4.3027 / math.sqrt(3))  # 2.4841
    assert (one_two_three.lo, one_two_three.hi) == pytest.approx((2 - 2.48417, 2 + 2.48417), abs=1e-5)
    single = st.mean_interval([5.0])
    assert single.to_dict() == {"mean": 5.0, "lo": None, "hi": None, "half_width": None, "n": 1}
    assert st.mean_interval([]) is None
    assert st.mean_interval([0.5, 0.5]).half_width == 0.0  # seeds that agree exactly


def test_welch_difference():
    # baseline [1, 2, 3]: mean 2, variance 1; variant [2, 4, 6]: mean 4, variance 4.
    # se^2 = 1/3 + 4/3 = 5/3; df = (5/3)^2 / ((1/3)^2/2 + (4/3)^2/2) = 50/17 = 2.94 -> t(2).
    diff = st.welch_difference([1.0, 2.0, 3.0], [2.0, 4.0, 6.0])
    assert diff.diff == 2.0
    assert diff.df == pytest.approx(50 / 17)
    assert diff.half_width == pytest.approx(4.3027 * math.sqrt(5 / 3))  # 5.55476
    assert diff.to_dict()["lo"] == pytest.approx(2.0 - 5.55476, abs=1e-5)
    # equal variances 2 and 2 with n 2: se^2 = 2, df = 4 / (1 + 1) = 2
    assert st.welch_difference([0.0, 2.0], [1.0, 3.0]).half_width == pytest.approx(4.3027 * math.sqrt(2))
    assert st.welch_difference([1.0], [2.0, 3.0]).to_dict() == {
        "diff": 1.5,
        "lo": None,
        "hi": None,
        "half_width": None,
        "df": None,
    }
    assert st.welch_difference([], [1.0]) is None
    assert st.welch_difference([1.0, 1.0], [2.0, 2.0]).half_width == 0.0


def test_trailing_means_and_the_step_a_target_is_reached():
    assert st.trailing_means([1.0, 2.0, 3.0, 4.0], 2) == [None, 1.5, 2.5, 3.5]
    values = [0.0, 0.25, 0.5, 0.0, 0.75, 1.0]
    # trailing means over 2: -, .125, .375, .25, .375, .875
    assert st.first_reaching(values, 0.5, 2) == 5
    assert st.first_reaching(values, 0.5, 1) == 2
    assert st.first_reaching(values, 0.375, 2) == 2
    assert st.first_reaching(values, 0.9, 2) is None
    assert st.first_reaching([1.0], 0.5, 2) is None  # never a full window


def test_best_and_last_windows():
    assert st.best_window_mean([1.0, 3.0, 2.0, 0.0], 2) == 2.5
    assert st.last_window_mean([1.0, 3.0, 2.0, 0.0], 2) == 1.0
    assert st.best_window_mean([1.0], 2) is None and st.last_window_mean([1.0], 2) is None


def test_interpolation_onto_a_time_grid():
    assert st.time_grid(10.0, 3) == [0.0, 5.0, 10.0]
    grid = [-1.0, 0.0, 5.0, 10.0, 15.0, 20.0, 25.0]
    assert st.interpolate([0.0, 10.0, 20.0], [0.0, 1.0, 3.0], grid) == [None, 0.0, 0.5, 1.0, 2.0, 3.0, None]
    assert st.interpolate([], [], [0.0]) == [None]
    assert st.ratio(6.0, 3.0) == 2.0 and st.ratio(None, 3.0) is None and st.ratio(1.0, 0.0) is None
