"""Peer-relative level and intermittency scores (monitor/peers.py)."""

import numpy as np

from megatron_rl.monitor.detect import DetectConfig, detect
from megatron_rl.monitor.peers import (
    SPREAD_CAP,
    intermittency_scores,
    level_scores,
    peer_spread,
    robust_z,
    trailing_mean,
    typical_spread,
    whole_step_span,
)
from megatron_rl.monitor.tuning import Tuning


def test_trailing_mean_ignores_nans_and_starts_short():
    x = np.array([[1.0, np.nan, 3.0, 5.0]])
    np.testing.assert_allclose(trailing_mean(x, 2), [[1.0, 1.0, 3.0, 4.0]])


def _means(rng, machines=32, windows=100):
    return rng.normal(0, 1, (1, machines, windows)).astype(np.float32)


def test_level_score_finds_a_half_step_offset_that_lasts():
    m = _means(np.random.default_rng(0))
    m[0, 5, 40:] -= 4.0  # one machine's level sits 4 window spreads below its peers
    z = level_scores(m, 4, 3)
    assert z[0, 5, 50:].min() > 4.5 and np.delete(z[0], 5, 0)[:, 50:].max() < 4.5


def test_intermittency_needs_abnormal_windows_in_every_slice():
    rng = np.random.default_rng(1)
    flap, burst = _means(rng), _means(rng)
    on = (np.arange(100) // 4) % 2 == 0  # 4 windows on, 4 off from window 0
    flap[0, 3, on] -= 20.0
    burst[0, 3, 40:47] -= 20.0  # one burst of 7 windows
    zf = intermittency_scores(flap, 21, 5.0, 3)
    zb = intermittency_scores(burst, 21, 5.0, 3)
    assert np.nanmin(zf[0, 3, 30:]) > 5
    assert np.nanmax(zb[0, 3]) < 1  # a single burst never fills all three slices


def test_a_link_at_half_bandwidth_is_declared_only_with_peer_scores(make_grid):
    # A small sustained offset (1.5 noise spreads): lost in each 8 s window's shape,
    # plain in the 32 s level.
    grid = make_grid(faults=[(6, "gpu_power", 100, 600, -1.5)])
    cfg = DetectConfig(threshold=5.0, continuity_s=120.0)
    assert [a.machine for a in detect(grid, cfg).alerts] == ["node06"]
    assert detect(grid, cfg, tuning=Tuning(peer_scores=False)).alerts == []


def test_whole_step_span_takes_the_whole_number_of_steps_nearest_the_target():
    assert whole_step_span(32.0, 7.0) == 35  # 5 steps (3 s off) rather than 4 (4 s off)
    assert whole_step_span(32.0, 6.5) == 33  # 5 steps = 32.5 s, rounded half up
    assert whole_step_span(32.0, 9.5) == 29  # 3 steps = 28.5 s
    assert whole_step_span(32.0, 40.0) == 40  # never less than one step
    assert whole_step_span(32.0, 8.0, step_s=2.0) == 16  # in samples


def test_peer_spread_is_the_windows_own_spread_between_one_and_two_typical_spreads():
    mad = np.array([[[1.0, 0.5, 1.0, 1.5, 5.0, 1.0, 0.8]]])  # typical (median over windows): 1.0
    assert SPREAD_CAP == 2.0
    np.testing.assert_allclose(peer_spread(mad), [[[1.0, 1.0, 1.0, 1.5, 2.0, 1.0, 1.0]]])


def test_a_deviation_keeps_half_its_z_when_the_healthy_machines_scatter():
    # 16 machines, 10 windows; in windows 6-7 the healthy machines split into two groups
    # 8 typical spreads apart (pipeline stages after a job-wide pause, seen through a step
    # average), and machine 0 sits 20 typical spreads below its peers throughout.
    rng = np.random.default_rng(0)
    s = rng.normal(0, 1, (1, 16, 10))
    s[0, 8:, 6:8] += 8.0  # half the healthy machines move together
    s[0, 0] -= 20.0
    z = robust_z(s, 0.05, 3)
    typical = np.median(1.4826 * np.median(np.abs(s - np.median(s, 1, keepdims=True)), 1))
    # The scattered windows' own spread is ~4x typical; the cap keeps the divisor at 2x.
    assert np.all(-z[0, 0, 6:8] > 20.0 / (2 * typical) - 2)
    assert np.all(-z[0, 0, 6:8] > 6.5)


def test_robust_z_without_a_floor_is_nan_where_nobody_spreads():
    """The window score's z (floor 0): where every machine has the same score in every
    window (no spread, no typical spread) there is no z, rather than inf or 0/0 warnings;
    with the level's floor of 0.05 the same scores give z 0. Too few machines: none."""
    s = np.full((1, 4, 3), 2.0)
    s[0, 3, 1] = 9.0  # one machine off in one window: the MAD is still 0
    assert np.isnan(robust_z(s, 0.0, 3)).all()
    np.testing.assert_allclose(robust_z(s, 0.05, 3)[0, :, 0], 0.0)
    assert robust_z(s, 0.05, 3)[0, 3, 1] == np.float32(7.0 / 0.05)
    assert np.isnan(robust_z(s, 0.05, 5)).all()  # 4 machines < min_machines 5


def test_a_metric_quiet_in_most_windows_is_scored_against_its_busy_windows_spread():
    """Scores equal on every machine in most windows (a bursty counter between bursts):
    the typical spread is that of the windows where they differ, not the zero of the
    majority, so a busy window keeps its own spread instead of a cap of 2 x 0, and a
    small difference in a quiet window scores against the busy spread (z 0.4), where it
    had no z at all."""
    mad = np.array([[[0.0, 0.0, 3.0, 0.0, 0.0]]])
    np.testing.assert_array_equal(peer_spread(mad), np.full_like(mad, 3.0))
    s = np.zeros((1, 4, 5))
    s[0, :, 2] = [1.0, 2.0, 3.0, 10.0]  # median 2.5, MAD 1.0 -> spread 1.4826
    s[0, 3, 4] = 0.6  # one machine slightly off in a quiet window: MAD still 0
    z = robust_z(s, 0.0, 3)
    np.testing.assert_allclose(z[0, :, 2], (np.array([1.0, 2.0, 3.0, 10.0]) - 2.5) / 1.4826, rtol=1e-6)
    np.testing.assert_allclose(z[0, :, 4], [0.0, 0.0, 0.0, 0.6 / 1.4826], rtol=1e-6)
    np.testing.assert_array_equal(z[0, :, [0, 1, 3]], 0.0)


def test_typical_spread_leaves_out_quiet_windows_only():
    """Six windows in which every machine agrees to rounding (0.01) and four busy ones:
    the median of all ten would be the rounding, the typical spread is the busy median.
    A metric whose windows are all of one kind keeps the plain median."""
    bimodal = np.array([[[0.01] * 6 + [2.0, 3.0, 4.0, 2.5]]])
    assert typical_spread(bimodal).item() == 2.75
    one_kind = np.array([[[1.0, 0.5, 1.0, 1.5, 5.0, 1.0, 0.8]]])
    assert typical_spread(one_kind).item() == 1.0
    assert np.isnan(typical_spread(np.zeros((1, 1, 4)))).all()  # no spread anywhere: none


def test_a_metric_with_no_spread_in_any_window_has_no_z():
    s = np.full((1, 4, 5), 2.0)
    assert np.isnan(robust_z(s, 0.0, 3)).all()
    np.testing.assert_array_equal(peer_spread(np.zeros((1, 1, 5))), 0.0)
