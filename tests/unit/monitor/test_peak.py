"""The peak score (peers.peak_scores): a link at half speed, seen only in its peak rate."""

from dataclasses import replace

import numpy as np

from megatron_rl.monitor.detect import DetectConfig, detect, peak_backing_s, peak_reach_s, peak_score, score_grid
from megatron_rl.monitor.peers import held_low, peak_scores, trailing_max
from megatron_rl.monitor.tuning import TUNING, Tuning
from megatron_rl.monitor.windows import Grid


def test_trailing_max_ignores_nans_and_starts_short():
    x = np.array([[1.0, np.nan, 3.0, 2.0, 0.0, 5.0, 1.0, 0.0, 0.0]])
    np.testing.assert_array_equal(trailing_max(x, 1), x)
    np.testing.assert_array_equal(trailing_max(x, 3), [[1, 1, 3, 3, 3, 5, 5, 5, 1]])
    np.testing.assert_array_equal(trailing_max(x, 5), [[1, 1, 3, 3, 3, 5, 5, 5, 5]])
    np.testing.assert_array_equal(trailing_max(np.array([[np.nan, np.nan, 2.0]]), 2), [[np.nan, np.nan, 2.0]])


def _win(peaks):
    """[machines, windows] window peaks -> [1, machines, windows, 2] windows (peak, 0)."""
    p = np.asarray(peaks, np.float32)
    return np.stack([p, np.zeros_like(p)], -1)[None]


def test_a_half_speed_link_scores_its_shortfall_in_tolerances_and_racks_do_not():
    # Two racks (capacity 10 and 8) and a rack-A machine at half speed: the peers' median
    # peak is 9 (of 5, 8, 8, 10, 10, 10) and every machine's own ratio is steady, so the
    # unit is the tolerance 0.05: rack B (8 / 9) scores (1 - 0.889) / 0.05 = 2.2, rack A
    # -2.2, the slow machine (1 - 5 / 9) / 0.05 = 8.9. A robust z across machines would
    # divide by the racks' spread (1.4826 * 1) and give the slow machine 2.7.
    peaks = [[10] * 4, [10] * 4, [10] * 4, [8] * 4, [8] * 4, [5] * 4]
    s = peak_scores(_win(peaks), 1, 0.05, 3)[0]
    np.testing.assert_allclose(s[:3], -1 / 9 / 0.05, rtol=1e-5)
    np.testing.assert_allclose(s[3:5], 1 / 9 / 0.05, rtol=1e-5)
    np.testing.assert_allclose(s[5], 4 / 9 / 0.05, rtol=1e-5)


def test_a_peak_that_is_not_a_capacity_scores_low():
    # Pause-frame-like bursts: each machine's largest burst alternates 50 / 150 around a
    # median of 100, so its own ratio is 0.5 or 1.5 (median 1, spread 1.4826 * 0.5); a
    # machine at half the median scores (1 - 0.5) / 0.741 = 0.67, not 10.
    peaks = [[50, 150] * 3, [50, 150] * 3, [150, 50] * 3, [150, 50] * 3]
    s = peak_scores(_win(peaks), 1, 0.05, 3)[0]
    np.testing.assert_allclose(s[0, 0], 0.5 / (1.4826 * 0.5), rtol=1e-5)


def test_no_peak_score_before_a_whole_span_or_with_a_gappy_span_or_an_idle_job():
    peaks = np.full((4, 8), 10.0)
    peaks[3] = 5.0
    win = _win(peaks)
    win[0, 2, 2:4] = np.nan  # machine 2 reports nothing in windows 2-3
    win[0, :, 5:] = 0.0  # the whole job idle from window 5: no median peak at 7
    s = peak_scores(win, 3, 0.05, 3, min_present=0.75)[0]
    assert np.isnan(s[:, :2]).all()  # the first two windows hold less than a span
    assert np.isnan(s[2, 4:6]).all() and s[2, 6] == 0  # 1 / 3, 2 / 3, then 3 / 3 present
    assert np.isnan(s[:, 7]).all()
    np.testing.assert_allclose(s[3, 2:7], 0.5 / 0.05)  # at 4-5 among three machines


def _link_grid(machines=16, duration=600, start=200, seed=0, step_time=False):
    """NVLink bursts of 2 s at rate 100 every 10 s, each machine 3 s after the previous
    (pipeline stages apart); from `start`, machine 0's link runs at half speed, so its
    bursts last 4 s at rate 50: the same bytes per step, the same mean."""
    rng = np.random.default_rng(seed)
    t = np.arange(duration)
    phase = (t[None] + 3 * np.arange(machines)[:, None]) % 10
    v = np.where(phase < 2, 100.0, 1.0)
    v[0, t >= start] = np.where(phase[0, t >= start] < 4, 50.0, 1.0)
    rows, names = [v * rng.normal(1, 0.02, v.shape)], ["nvlink_bandwidth"]
    if step_time:  # machine 0 reports steps of 5 s, the others 10 s: a low peak of its own
        rows.append(np.broadcast_to(np.where(np.arange(machines) == 0, 5.0, 10.0)[:, None], v.shape))
        names.append("step_time")
    return Grid(np.stack(rows).astype(np.float32), names, [f"node{i:02d}" for i in range(machines)], start=0.0)


def test_a_half_speed_link_with_the_same_mean_is_declared_only_with_the_peak_score():
    grid = _link_grid()
    alerts = detect(grid, DetectConfig()).alerts
    assert [(a.machine, a.metric) for a in alerts] == [("node00", "nvlink_bandwidth")]
    assert alerts[0].first_seen >= 200
    assert detect(grid, DetectConfig(), tuning=Tuning(peak_score=False)).alerts == []


def test_step_metrics_get_no_peak_score():
    grid = _link_grid(step_time=True)
    on, off = score_grid(grid, DetectConfig()), score_grid(grid, DetectConfig(), tuning=Tuning(peak_score=False))
    assert np.nanmax(peak_score(grid.values, DetectConfig(), TUNING, None)[0][1, 0]) > 6.5  # it would score
    np.testing.assert_array_equal(on.z[1], off.z[1])
    assert np.nanmax(on.z[0, 0]) > 6.5 > np.nanmax(off.z[0, 0])


def test_a_shortfall_scores_only_where_it_held_for_the_last_windows():
    score = np.array([[[1.0, 9.0, 2.0, 9.0, 9.0, np.nan, 9.0, 9.0]]])
    # Two windows: the smallest of each window and the one before; NaN at the start and
    # next to a NaN. The lone 9 at window 1 (one window of a transient) is gone.
    np.testing.assert_array_equal(held_low(score, 2)[0, 0], [np.nan, 1.0, 2.0, 2.0, 9.0, np.nan, np.nan, 9.0])
    np.testing.assert_array_equal(held_low(score, 1), score)


def test_the_peak_spans_at_least_peak_span_s_or_peak_steps_steps():
    grid = _link_grid()
    cfg = DetectConfig()  # peak_span_s 80, peak_steps 4
    s = peak_score(grid.values, cfg, TUNING, 8.0)  # 4 steps of 8 s = 32 s: the 80 s span rules
    wide = replace(TUNING, peak_span_s=10.0, peak_steps=10)
    np.testing.assert_array_equal(s, peak_score(grid.values, cfg, wide, 8.0))
    assert not np.array_equal(s, peak_score(grid.values, cfg, replace(TUNING, peak_span_s=32.0), 8.0), equal_nan=True)
    long = peak_score(grid.values, cfg, TUNING, 60.0)  # 4 steps of 60 s = 240 s: the steps rule
    np.testing.assert_array_equal(long, peak_score(grid.values, cfg, replace(TUNING, peak_span_s=240.0), None))


def test_a_deep_peak_backs_its_run_by_one_base_span_at_most():
    cfg = DetectConfig()  # peak_span_s 80, peak_steps 4, peak_hold_windows 2
    assert peak_backing_s(cfg, TUNING, 8.0) == peak_reach_s(cfg, TUNING, 8.0) == 80.0  # short steps: the whole span
    assert peak_reach_s(cfg, TUNING, 60.0) == 240.0  # four 60 s steps
    assert peak_backing_s(cfg, TUNING, 60.0) == 80.0  # so that continuity_s (110 s) still needs 30 s of windows


def _slow_link_grid(speed, machines=16, duration=600, start=200, seed=0):
    """As _link_grid, with machine 0's link at `speed` of its peers' from `start`."""
    grid = _link_grid(machines, duration, start, seed)
    t = np.arange(duration)
    phase = (t + 0) % 10
    slow = np.where(phase < 2 / speed, 100.0 * speed, 1.0)
    grid.values[0, 0, t >= start] = slow[t >= start] * np.random.default_rng(seed + 1).normal(
        1, 0.02, (t >= start).sum()
    )
    return grid


def test_a_link_under_half_speed_counts_its_continuity_from_the_fault():
    # At 0.4x the peak is 60 % short, at least peak_since_shortfall (0.3), so from the first
    # window whose peak shows it, the run counts from where that peak's span began: the
    # fault's start (200 s), or up to 8 s before it, since no burst was due there (the
    # last healthy one is at 190-191 s). Declared continuity_s (110 s) after that, within
    # two windows. Counted from its first window instead, the run starts a peak span (80 s)
    # later.
    cfg = DetectConfig()
    grid = _slow_link_grid(0.4)
    early = detect(grid, cfg).alerts
    late = detect(grid, cfg, tuning=Tuning(peak_since_shortfall=0.0)).alerts
    assert [a.machine for a in early] == [a.machine for a in late] == ["node00"]
    assert 192 + cfg.continuity_s <= early[0].declared_at <= 200 + cfg.continuity_s + 2 * cfg.stride_s
    assert late[0].declared_at - early[0].declared_at >= TUNING.peak_span_s


def test_a_link_at_six_tenths_counts_from_the_fault_too():
    # At 0.6x the peak is 40 % short (score 8 > 6.5 in a capacity's 5 % unit): also at
    # least 0.3, so it counts from the fault's start as well. With a depth of 0.5 (under
    # half the peers') it counts from its first window, as with the rule off; here the window
    # score already sees the slower transfers from 208 s, so that is 16 s later, not a whole
    # peak span.
    cfg = DetectConfig()
    grid = _slow_link_grid(0.6)
    early = detect(grid, cfg).alerts
    old = detect(grid, cfg, tuning=Tuning(peak_since_shortfall=0.5)).alerts
    assert [a.machine for a in early] == ["node00"]
    assert 192 + cfg.continuity_s <= early[0].declared_at <= 200 + cfg.continuity_s + 2 * cfg.stride_s
    assert old == detect(grid, cfg, tuning=Tuning(peak_since_shortfall=0.0)).alerts
    assert old[0].declared_at > early[0].declared_at


def test_deep_peaks_need_a_capacity_and_enough_spans():
    from megatron_rl.monitor.detect import deep_peaks

    cfg = DetectConfig()
    short = np.full((2, 4, 60), 0.6, np.float32)  # every machine 60 % short (only the rule is tested)
    score = short / 0.05
    steady = np.array([0.01, 0.3]).reshape(2, 1, 1)  # a capacity, and bursts of random size
    deep = deep_peaks(score, short, steady, 10, cfg, TUNING)
    assert deep[0, :, 1:].all() and not deep[1].any()  # the first window has no window before it to hold
    assert not deep_peaks(score, short, steady, 13, cfg, TUNING).any()  # 60 windows hold fewer than 5 spans of 13
    assert not deep_peaks(score, short * 0.4, steady, 10, cfg, TUNING).any()  # 24 % short: under peak_since_shortfall
    assert not deep_peaks(score, short, steady, 10, cfg, Tuning(peak_since_shortfall=0.0)).any()


def test_a_peak_missing_its_burst_samples_is_not_deep():
    # Healthy machines; node05's sampler drops both burst seconds of every step from 300 s
    # (its bursts are at 5-6 s of each 10, pipeline offset 15 s). Its peak then reads at
    # the idle level, far under half the peers', and scores; but the seconds that would
    # have shown the burst were never sampled, so the peak is not deep.
    grid = _link_grid(start=10_000)  # no slow link
    t = np.arange(grid.values.shape[-1])
    grid.values[0, 5, (t >= 300) & ((t + 15) % 10 < 2)] = np.nan
    score, deep = peak_score(grid.values, DetectConfig(), TUNING, None)
    assert np.nanmax(score[0, 5]) > 6.5 and not deep[0, 5].any()
    assert not deep.any()
