"""The window score without what sampler skew explains (monitor/skew.py)."""

import numpy as np

from megatron_rl.monitor.detect import DetectConfig, score_grid
from megatron_rl.monitor.skew import skew_distances
from megatron_rl.monitor.tuning import Tuning
from megatron_rl.monitor.windows import Grid, normalise_centred


def test_skew_distances_take_the_best_shift_within_the_lag_by_hand():
    # Median 0 everywhere except a burst of 4 at t=3; one machine reads it at t=2 or t=5.
    centre = np.zeros((1, 1, 8), np.float32)
    centre[0, 0, 3] = 4.0
    x = np.zeros((1, 2, 8), np.float32)
    x[0, 0, 2] = 4.0  # one second early
    x[0, 1, 5] = 4.0  # two seconds late
    resid = x - centre
    # Unshifted: |4| + |-4| over 8 s = 1.0 for both.
    np.testing.assert_allclose(skew_distances(resid, centre, 0, 8, 8)[0, :, 0], [1.0, 1.0])
    # Windows of 4 s. Lag 1: the early one matches exactly (in the first window over the
    # 3 s a shift to t - 1 leaves inside the trace); the late one's best stays 4 / 4 = 1.0.
    # Lag 2: the late one matches too, its last window over the 2 s inside the trace.
    np.testing.assert_allclose(skew_distances(resid, centre, 1, 4, 4)[0, :, :], [[0.0, 0.0], [1.0, 1.0]])
    np.testing.assert_allclose(skew_distances(resid, centre, 2, 4, 4)[0, :, :], [[0.0, 0.0], [0.0, 0.0]])


def _bursty_grid(shift_machine=None, half_machine=None, machines=8, seconds=400, seed=0):
    """A network counter at ~1 % of its peak, with a 2 s transfer at 100x every 10 s read
    by every machine at the same second, except `shift_machine` (2 s early) and
    `half_machine` (a NIC at half speed: half the rate for twice as long)."""
    rng = np.random.default_rng(seed)
    t = np.arange(seconds)
    v = np.full((1, machines, seconds), 1.0) * rng.uniform(0.9, 1.1, (1, machines, seconds))
    burst = (t % 10 >= 4) & (t % 10 < 6)
    v[0][:, burst] = 100.0 * rng.uniform(0.97, 1.03, (machines, burst.sum()))
    if shift_machine is not None:
        v[0, shift_machine] = np.roll(v[0, shift_machine], -2)
    if half_machine is not None:
        slow = (t % 10 >= 4) & (t % 10 < 8)
        v[0, half_machine] = np.where(slow, 50.0, v[0, half_machine])
    return Grid(v.astype(np.float32), ["net_tx_bytes"], [f"node{i:02d}" for i in range(machines)], 0.0, 1.0)


def _window_score(grid, skew_s):
    return score_grid(grid, DetectConfig(), None, Tuning(skew_s=skew_s, peer_scores=False)).z[0]


def test_a_machine_reading_bursts_two_seconds_early_is_no_outlier_with_skew_s_2():
    z_plain, z_skew = (
        _window_score(_bursty_grid(shift_machine=3), 0.0),
        _window_score(_bursty_grid(shift_machine=3), 2.0),
    )
    assert np.nanmedian(z_plain[3]) > 6.5  # without the shift it is the outlier in most windows
    assert np.nanmax(z_skew[3]) < 6.5


def test_a_nic_at_half_speed_is_still_an_outlier_with_skew_s_2():
    z = _window_score(_bursty_grid(half_machine=5), 2.0)
    assert np.nanmin(z[5]) > 6.5 and np.nanmax(np.delete(z, 5, 0)) < 6.5


def test_normalise_centred_gives_the_median_in_the_residuals_units():
    v = np.array([[[1.0, 2.0], [3.0, 6.0], [5.0, 10.0]]], np.float32)  # median machine 1
    resid, scale, centre = normalise_centred(v)
    np.testing.assert_allclose(resid * scale[:, None, None] + centre * scale[:, None, None], v, rtol=1e-6)
    np.testing.assert_allclose(centre[0, 0] * scale[0], [3.0, 6.0], rtol=1e-6)


def test_skew_distances_match_a_direct_loop_over_shifts_and_seconds():
    rng = np.random.default_rng(3)
    resid = rng.normal(0, 1, (2, 5, 45)).astype(np.float32)
    resid[0, 1, 20] = np.nan  # a missing sample voids its window unshifted
    centre = rng.normal(0, 3, (2, 1, 45)).astype(np.float32)
    got = skew_distances(resid, centre, 2, 8, 8)  # 5 windows from offset 5
    x = resid + centre
    want = np.full((2, 5, 5), np.inf)
    for w in range(5):
        seconds = range(5 + 8 * w, 13 + 8 * w)
        for d in range(-2, 3):
            inside = [t for t in seconds if 0 <= t + d < 45]
            dist = np.mean([np.abs(x[:, :, t + d] - centre[:, :, t]) for t in inside], axis=0)
            want[:, :, w] = np.fmin(want[:, :, w], dist)
    np.testing.assert_allclose(got, want, rtol=1e-5)
