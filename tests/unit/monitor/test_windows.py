"""Resampling to a grid, gap filling, normalisation and windowing."""

import warnings

import numpy as np

from megatron_rl.monitor.trace import Trace
from megatron_rl.monitor.windows import (
    complete_trailing_mean,
    complete_trailing_mean_at,
    cut_windows,
    fill_gaps,
    fill_gaps_from,
    nanmedian,
    nanquantile,
    normal_windows,
    normalise,
    normalise_lagged,
    to_grid,
    window_times,
)


def test_to_grid_bins_to_nearest_second_averages_duplicates_and_orders_metrics():
    rows = [
        (10.0, "a", "gpu_power", 100.0),
        (10.9, "a", "gpu_power", 110.0),  # 10.9 -> second 11
        (11.1, "a", "gpu_power", 130.0),  # also second 11: averaged with 110
        (10.0, "b", "cpu_util", 5.0),
        (12.0, "b", "cpu_util", float("nan")),  # NaN = absent
        (12.2, "a", "cpu_util", 7.0),
    ]
    g = to_grid(Trace.from_rows(rows))
    assert g.metrics == ["cpu_util", "gpu_power"] and g.machines == ["a", "b"] and g.start == 10.0
    assert g.values.shape == (2, 2, 3)
    np.testing.assert_array_equal(g.values[1, 0], [100.0, 120.0, np.nan])
    np.testing.assert_array_equal(g.values[0, 1], [5.0, np.nan, np.nan])
    np.testing.assert_array_equal(g.values[0, 0], [np.nan, np.nan, 7.0])
    np.testing.assert_array_equal(g.times(), [10.0, 11.0, 12.0])


def test_fill_gaps_fills_short_holes_only():
    x = np.array([[1, np.nan, np.nan, 4, np.nan, np.nan, np.nan, np.nan, 9]], np.float32)
    np.testing.assert_array_equal(fill_gaps(x, 2), [[1, 1, 1, 4, np.nan, np.nan, np.nan, np.nan, 9]])
    lead = np.array([[np.nan, 2.0, np.nan]], np.float32)
    np.testing.assert_array_equal(fill_gaps(lead, 3), [[np.nan, 2.0, 2.0]])  # nothing to carry at the start
    tail = np.array([[5.0, np.nan, np.nan, np.nan, np.nan]], np.float32)
    np.testing.assert_array_equal(fill_gaps(tail, 2), tail)  # a machine that left stays absent


def test_fill_gaps_from_fills_the_same_holes_with_the_median_at_that_second():
    nan = np.nan
    x = np.array(
        [
            [1, 100, nan, 1, 1, 1],  # a sample dropped right after a burst
            [1, 100, 3, 1, 1, 1],
            [1, 100, 5, nan, nan, nan],
        ],
        np.float32,
    )  # a run of 3 with a value before it
    x = np.stack([x, 10 * x])  # a second metric: its own medians
    centre = nanmedian(x, axis=1, keepdims=True)  # second 2: median(3, 5) = 4; seconds 3-5: 1
    filled = fill_gaps_from(x, centre, 3)
    np.testing.assert_array_equal(filled[0, 0], [1, 100, 4, 1, 1, 1])  # a forward fill gives 100
    np.testing.assert_array_equal(filled[0, 2], [1, 100, 5, 1, 1, 1])
    np.testing.assert_array_equal(filled[1, 0], [10, 1000, 40, 10, 10, 10])
    short = fill_gaps_from(x, centre, 2)  # the run of 3 is too long: it stays a gap
    np.testing.assert_array_equal(short[0, 2], [1, 100, 5, nan, nan, nan])
    for max_gap in (1, 2, 3):  # the same holes as a forward fill
        np.testing.assert_array_equal(np.isnan(fill_gaps_from(x, centre, max_gap)), np.isnan(fill_gaps(x, max_gap)))


def test_normalise_reads_a_short_gap_as_no_deviation():
    rng = np.random.default_rng(1)
    t = np.arange(60)
    v = np.where(t % 10 == 5, 100.0, 1.0)[None, None] + rng.normal(0, 0.1, (1, 6, 60))
    v[0, 0, 16] = np.nan  # the second after machine 0's burst at 15
    resid, scale = normalise(v.astype(np.float32))
    assert resid[0, 0, 16] == 0.0
    assert scale[0] < 1.0  # a forward fill would have read (100 - 1) / scale there


def test_nanmedian_matches_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 9, 6)).astype(np.float32)
    x[rng.random(x.shape) < 0.3] = np.nan
    x[0, :, 0] = np.nan  # an all-NaN column
    for axis in (0, 1, 2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            want = np.nanmedian(x, axis=axis)
        np.testing.assert_allclose(nanmedian(x, axis=axis), want, rtol=1e-6, equal_nan=True)


def test_nanquantile_matches_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 9, 6)).astype(np.float32)
    x[rng.random(x.shape) < 0.3] = np.nan
    x[0, :, 0] = np.nan  # an all-NaN column
    for q in (0.0, 0.3, 0.5, 1.0):
        for axis in (0, 1, 2):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                want = np.nanquantile(x.astype(np.float64), q, axis=axis)
            np.testing.assert_allclose(nanquantile(x, q, axis=axis), want, rtol=1e-6, atol=1e-7, equal_nan=True)


def test_normalise_removes_common_movement_and_scales_by_spread():
    rng = np.random.default_rng(1)
    common = np.linspace(0, 1000, 200)  # a huge shared trend
    noise = rng.normal(0, 2.0, (1, 50, 200))
    resid, scale = normalise((common[None, None] + noise).astype(np.float32))
    assert abs(scale[0] - 2.0) < 0.2  # the spread of the machines, not of the trend
    assert abs(np.median(resid)) < 0.05 and 0.9 < np.median(np.abs(resid)) * 1.4826 < 1.1


def test_normalise_floors_the_scale_of_identical_machines():
    x = np.full((1, 5, 20), 100.0, np.float32)
    x[0, 2, 10] = 101.0
    resid, scale = normalise(x)
    assert abs(scale[0] - 0.1) < 1e-6  # 0.1 % of the level, not 0
    assert abs(resid[0, 2, 10] - 10.0) < 1e-4 and np.isfinite(resid).all()


def test_windows_align_to_the_end():
    x = np.arange(20, dtype=np.float32)[None]
    w = cut_windows(x, 8, 8)
    np.testing.assert_array_equal(w[0, 0], np.arange(4, 12))  # 20 = 4 + 2*8: the first 4 are dropped
    np.testing.assert_array_equal(w[0, -1], np.arange(12, 20))
    w2 = cut_windows(x, 8, 4)
    assert w2.shape == (1, 4, 8) and w2[0, -1, -1] == 19

    class G:
        values, start, step_s = np.zeros((1, 1, 20)), 100.0, 1.0

    start, end = window_times(G, 8, 8)
    np.testing.assert_array_equal(start, [104.0, 112.0])
    np.testing.assert_array_equal(end, [111.0, 119.0])


def test_normal_windows_drop_incomplete_ones(make_grid):
    g = make_grid(machines=4, duration=64, metrics=["cpu_util"])
    g.values[0, 1, 5:20] = np.nan  # 15 s hole: longer than the 3 s fill, voids 2-3 windows
    w = normal_windows(g, 8)["cpu_util"]
    assert w.shape[1] == 8 and not np.isnan(w).any()
    assert 4 * 8 - 3 <= w.shape[0] <= 4 * 8 - 2


def test_fill_gaps_matches_a_brute_force_reference():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 50)).astype(np.float32)
    x[rng.random(x.shape) < 0.3] = np.nan
    want = x.copy()
    for idx in np.ndindex(x.shape[:-1]):
        row, t = x[idx], 0
        while t < row.size:
            end = t
            while end < row.size and np.isnan(row[end]):
                end += 1
            if end > t and t > 0 and end - t <= 2:
                want[idx][t:end] = row[t - 1]
            t = max(end, t + 1)
    np.testing.assert_array_equal(fill_gaps(x, 2), want)


def test_nanmedian_of_nothing_is_nan_and_a_too_short_trace_declares_nothing():
    from megatron_rl.monitor.detect import detect
    from megatron_rl.monitor.windows import Grid

    assert np.isnan(nanmedian(np.empty((3, 0), np.float32), axis=1)).all()
    short = Grid(np.ones((2, 5, 4), np.float32), ["cpu_util", "gpu_power"], [f"m{i}" for i in range(5)], 0.0)
    assert detect(short).alerts == []  # 4 s: no 8 s window yet


def test_complete_trailing_mean_averages_the_span_ending_at_each_sample():
    x = np.arange(1.0, 11.0, dtype=np.float32)[None]  # 1 .. 10
    np.testing.assert_array_equal(complete_trailing_mean(x, 4)[..., [3, 9]], [[2.5, 8.5]])
    assert np.isnan(complete_trailing_mean(x, 4)[..., :3]).all()  # reaches before the first sample
    gappy = x.copy()
    gappy[0, 5] = np.nan
    # 9 of 10 samples are enough (90 %), 3 of 4 are not.
    np.testing.assert_array_equal(complete_trailing_mean(gappy, 10)[..., [9]], [[np.float32(49.0 / 9)]])
    assert np.isnan(complete_trailing_mean(gappy, 4)[..., [7]]).all()


def _step_values(lags, slow=None, n_t=120, step=10):
    """Step times of 5 machines: step j lasts 7 + j % 3 s and is recorded at t = 10 (j+1);
    machine i picks each new value up lags[i] s late; `slow` = (machine, factor)."""
    v = np.zeros((1, len(lags), n_t), np.float32)
    for i, lag in enumerate(lags):
        for t in range(n_t):
            j = max(0, (t - lag) // step - 1)
            v[0, i, t] = 7.0 + j % 3 + 0.001 * i  # a millisecond of timer difference
    if slow:
        v[0, slow[0]] *= slow[1]
    return v


def test_lagged_normalisation_forgives_a_machine_that_samples_the_new_step_late():
    v = _step_values([0, 0, 0, 0, 3])
    plain = normalise(v)[0]
    lagged, _ = normalise_lagged(v, lag=3)
    # Plainly, machine 4 is a whole step change (1-2 s) off for 3 s of every step: hundreds
    # of scale units (the scale is the millisecond differences).
    assert np.nanmax(np.abs(plain[0, 4])) > 100
    assert np.nanmax(np.abs(lagged[0, 4])) < 10  # within a few ms of a nearby median
    # One second of lag too many is not forgiven.
    assert np.nanmax(np.abs(normalise_lagged(_step_values([0, 0, 0, 0, 4]), lag=3)[0][0, 4])) > 100


def test_lagged_normalisation_keeps_a_machine_that_is_really_slower():
    v = _step_values([0, 0, 0, 0, 0], slow=(2, 1.25))  # 25 % slower: 1.75-2.25 s a step
    lagged, scale = normalise_lagged(v, lag=3)
    # Within 3 s its value meets at most two medians, this step's and a neighbour's: 8.75
    # against 7 (or the previous step's 9 near a boundary), 10 against 8 (or 7), 11.25
    # against 9 (or 8). So it is off by at least 0.25 s in every second, by 0.75 s or more
    # in most, and by 2.25 s in some.
    off_s = np.abs(lagged[0, 2, 20:]) * scale[0]
    assert off_s.min() > 0.249 and np.median(off_s) > 0.749 and off_s.max() > 2.249


def test_complete_trailing_mean_at_gives_the_full_versions_numbers_bit_for_bit():
    rng = np.random.default_rng(3)
    x = (rng.random((3, 7, 60)) * 1e9).astype(np.float32)
    x[rng.random(x.shape) < 0.05] = np.nan
    x[0, 0, :9] = np.nan  # a late start: fewer than min_present of the first spans
    x[1, 2] = rng.random(60).astype(np.float32)  # a row without gaps: the other rounding path
    x[1, 2, 5] = 1.0
    for span in (1, 4, 17):
        for at in (np.arange(3, 60, 8), np.array([0, 16, 59])):
            want = complete_trailing_mean(x, span)[..., at]
            np.testing.assert_array_equal(complete_trailing_mean_at(x, span, at), want)
