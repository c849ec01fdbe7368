"""The step period estimated from a trace, and the time scales that follow it."""

import numpy as np
import pytest

from megatron_rl.monitor.config import DetectConfig
from megatron_rl.monitor.detect import detect
from megatron_rl.monitor.period import (
    autocorrelation_period,
    average_span,
    estimate_period,
    step_average,
    time_scales,
    unchanged_for,
    without_stale_steps,
)
from megatron_rl.monitor.trace import STEP_METRICS
from megatron_rl.monitor.tuning import TUNING, Tuning
from megatron_rl.monitor.windows import Grid

METRICS = ["cpu_util", "gpu_duty_cycle", "gpu_power"]


def stepping_grid(period=60.0, machines=16, duration=900, duty=0.7, stages=1, noise=3.0, seed=0, jitter=0.05) -> Grid:
    """Machines running one compute/communicate step every `period` s (duty cycle `duty`),
    read once a second as the average over that second, split into `stages` pipeline
    stages that start the step 1/stages of a step apart; step lengths jitter together on
    every machine (a random walk of time); Gaussian noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(duration, dtype=np.float64)
    warp = np.cumsum(rng.normal(0, jitter, duration))
    stage = (np.arange(machines) * stages // machines) / stages
    u = (t[None] + warp[None] + stage[:, None] * period + rng.uniform(0, 1, (machines, 1))) / period
    # Each reading is the busy share of the second before it (NVML and psutil average over
    # their sample interval): ten sub-second points per reading.
    sub = u[..., None] - np.arange(10) / (10 * period)
    busy = (np.mod(sub, 1.0) < duty).mean(-1)
    values = np.stack([20 + 10 * (1 - busy), 35 + 60 * busy, 150 + 500 * busy])
    values = values + rng.normal(0, noise, values.shape)
    return Grid(values.astype(np.float32), list(METRICS), [f"node{i:02d}" for i in range(machines)], 0.0)


@pytest.mark.parametrize("period", [8.0, 20.0, 45.0, 60.0, 90.0])
@pytest.mark.parametrize("stages", [1, 4])
def test_autocorrelation_finds_the_step_period_within_a_few_percent(period, stages):
    est = estimate_period(stepping_grid(period=period, stages=stages))
    assert est == pytest.approx(period, rel=0.04)


def test_the_period_does_not_depend_on_gaps_or_on_which_machines_are_looked_at():
    grid = stepping_grid(period=60.0, machines=200, stages=8)
    rng = np.random.default_rng(1)
    grid.values[rng.random(grid.values.shape) < 0.02] = np.nan
    grid.values[:, 3, :300] = np.nan  # a machine joining late
    assert autocorrelation_period(grid.values, max_machines=64) == pytest.approx(60.0, rel=0.04)
    assert autocorrelation_period(grid.values, max_machines=200) == pytest.approx(60.0, rel=0.04)


def test_no_period_in_noise_or_a_flat_trace():
    rng = np.random.default_rng(0)
    noise = rng.normal(0, 1, (3, 16, 900)).astype(np.float32)
    assert autocorrelation_period(noise) is None
    assert autocorrelation_period(np.ones((3, 16, 900), np.float32)) is None
    assert autocorrelation_period(noise[..., :8]) is None  # too short to see three periods


def test_reported_step_time_wins_over_the_autocorrelation():
    grid = stepping_grid(period=60.0)
    step = np.full((1, 16, 900), 75.0, np.float32)  # the trainer says 75 s
    both = Grid(np.concatenate([grid.values, step]), METRICS + ["step_time"], grid.machines, 0.0)
    assert estimate_period(both) == 75.0


def test_short_steps_keep_the_default_time_scales():
    cfg = DetectConfig()
    for period in (None, 6.0, 12.0, 16.0):
        s = time_scales(cfg, TUNING, period)
        assert (s.average_s, s.continuity_s, s.intermittency_span_s) == (0.0, cfg.continuity_s, 180.0)


def test_long_steps_average_one_step_and_need_several_steps_of_continuity():
    cfg = DetectConfig()
    s = time_scales(cfg, TUNING, 60.0)
    assert s.average_s == 60.0
    assert s.continuity_s == max(cfg.continuity_s, TUNING.continuity_steps * 60.0) == 240.0
    assert s.intermittency_span_s == 180.0 + 3 * 60.0  # each slice outlasts a step-averaged transient
    assert s.step_continuity_s == max(cfg.continuity_s, TUNING.straggler_steps * 60.0)
    assert time_scales(cfg, TUNING, 30.0).continuity_s == 120.0  # max(110 s, 4 steps of 30 s)
    assert time_scales(cfg, TUNING, 30.0).average_s == 30.0  # > level_span_s / 2: averaged
    off = time_scales(cfg, Tuning(follow_step=False), 60.0)
    assert (off.average_s, off.continuity_s, off.step_continuity_s) == (0.0, cfg.continuity_s, 180.0)
    with pytest.raises(ValueError, match="continuity_steps"):
        Tuning(continuity_steps=-1)


def test_a_step_average_removes_pipeline_stage_phases_but_keeps_a_slow_machine():
    grid = stepping_grid(period=60.0, stages=4, noise=0.0, jitter=0.0)
    grid.values[:, 5] *= 0.8  # one machine works at 80 %
    avg = step_average(grid.values, 60, 3, grid.metrics)
    assert np.isnan(avg[..., :59]).all()  # no whole step yet
    power = avg[2, :, 60:]
    healthy = np.delete(power, 5, axis=0)
    assert np.ptp(healthy, axis=0).max() < 0.03 * power.mean()  # phases cancelled (±1 s sampler phase)
    assert (power[5] < 0.85 * np.median(healthy, axis=0)).all()


def test_a_step_average_leaves_step_metrics_alone_and_voids_partial_steps():
    values = np.ones((2, 4, 200), np.float32)
    values[0, 1, 100:120] = np.nan  # 20 s gap: longer than a fill, so the steps around it are partial
    out = step_average(values, 60, 3, ["cpu_util", "step_time"])
    assert np.array_equal(out[1], values[1])
    # Means over fewer than 90 % of a step (> 6 of 60 s missing) end at 106 ... 172 s.
    assert np.isnan(out[0, 1, 106:173]).all() and not np.isnan(out[0, 1, 173:]).any()
    assert not np.isnan(out[0, 0, 59:]).any() and np.isnan(out[0, :, :59]).all()
    assert np.allclose(out[0, 0, 59:], 1.0)


@pytest.mark.parametrize("stages", [2, 3, 8])
def test_pipeline_stages_tens_of_seconds_apart_do_not_alarm(stages):
    from megatron_rl.monitor.detect import detect

    grid = stepping_grid(period=60.0, machines=16, stages=stages, seed=2)
    grid.values[1, 3, :] = np.nan  # and a machine without one sensor, as on real clusters
    det = detect(grid, DetectConfig())
    assert det.scores.step_period_s == pytest.approx(60.0, rel=0.04)
    assert det.scores.scales.average_s == det.scores.step_period_s
    assert det.alerts == []


def test_a_machine_at_80_percent_is_found_after_continuity_steps_steps():
    from megatron_rl.monitor.detect import detect

    grid = stepping_grid(period=60.0, machines=16, stages=4, seed=3)
    grid.values[1:, 9, 300:] *= 0.8  # GPU duty and power at 80 % from 300 s
    alerts = detect(grid, DetectConfig()).alerts
    assert [a.machine for a in alerts] == ["node09"]
    assert alerts[0].declared_at - alerts[0].first_seen >= 4 * 60.0 * 0.96
    assert alerts[0].declared_at <= 300 + 60 + 4 * 60 + 2 * 8  # one step to show, four to declare


@pytest.mark.parametrize("period, stages", [(7.0, 4), (9.5, 3)])
def test_a_gpu_at_92_percent_beside_pipeline_stages_is_found_by_whole_step_levels(period, stages):
    # Short steps, stages a fraction of a step apart: 32 s of window means is not a whole
    # number of steps, and its left-over part of a step differs from stage to stage.
    from megatron_rl.monitor.detect import detect

    grid = stepping_grid(period=period, machines=16, duration=600, stages=stages, seed=0)
    assert detect(grid, DetectConfig()).alerts == []  # the healthy job does not alarm
    grid.values[1:, 5, 200:] *= 0.92  # GPU duty and power at 92 % from 200 s
    alerts = detect(grid, DetectConfig()).alerts
    assert [a.machine for a in alerts] == ["node05"]
    need = DetectConfig().continuity_s
    assert 200 + need <= alerts[0].declared_at <= 200 + need + 32 + 2 * 8  # continuity, level, windows
    assert detect(grid, DetectConfig(), tuning=Tuning(whole_step_level=False)).alerts == []


def test_long_steps_are_step_averaged_not_given_whole_step_levels():
    from megatron_rl.monitor.detect import periods, whole_step_levels

    grid = stepping_grid(period=60.0, stages=4, seed=1)
    cfg = DetectConfig()
    step, cycle = periods(grid, TUNING)
    assert step == pytest.approx(60.0, rel=0.04) and cycle == step
    assert (
        whole_step_levels(np.zeros((3, 16, 900), np.float32), cfg, TUNING, time_scales(cfg, TUNING, step), cycle)
        is None
    )


def test_the_step_average_spans_the_metrics_own_cycle_when_it_is_the_same_step():
    assert average_span(62.4, 60.0) == 60.0  # the reported median step a few per cent long
    assert average_span(60.0, None) == 60.0  # no clear cycle: the reported step
    assert average_span(60.0, 30.0) == 60.0  # half a step (or a sub-step cycle) is not the step
    assert average_span(60.0, 120.0) == 60.0
    cfg = DetectConfig()
    s = time_scales(cfg, TUNING, 62.4, 60.0)
    assert (s.average_s, s.continuity_s) == (60.0, 4 * 62.4)  # continuity still counts reported steps
    assert s.intermittency_span_s == 180.0 + 3 * 60.0
    assert time_scales(cfg, TUNING, 8.0, 8.1).average_s == 0.0  # short steps are not averaged


def test_a_reported_step_four_percent_long_still_averages_whole_cycles():
    # Four pipeline stages 15 s apart, 60 s steps; the trainer's step times say 62.4 s.
    from megatron_rl.monitor.detect import detect

    grid = stepping_grid(period=60.0, machines=16, stages=4, noise=0.0, jitter=0.0, seed=4)
    step = np.full((1, 16, 900), 62.4, np.float32)
    both = Grid(np.concatenate([grid.values, step]), METRICS + ["step_time"], grid.machines, 0.0)
    scales = detect(both, DetectConfig()).scores.scales
    assert scales.period_s == pytest.approx(62.4) and scales.average_s == pytest.approx(60.0, rel=0.01)
    # Healthy machines' step means of GPU power: spread by the stages over 62 s, not over 60 s.
    power = lambda span: step_average(grid.values, span, 3, METRICS)[2, :, 120:]  # noqa: E731
    assert np.ptp(power(60), axis=0).max() < 0.25 * np.ptp(power(62), axis=0).max()


def test_unchanged_for_counts_samples_since_the_value_last_changed_across_gaps():
    x = np.array([[np.nan, 5.0, 5.0, 7.0, np.nan, 7.0, 7.0, 8.0]])
    # A leading gap is new, a gap inside carries the value on, 7 -> 7 across it is no change.
    np.testing.assert_array_equal(unchanged_for(x), [[0, 0, 1, 0, 1, 2, 3, 0]])


def _hung_steps(machines=16, steps_before=30, duration=600, step_s=8.0, slow_last=3):
    """Step metrics of `machines` ranks with 8 s steps until step `steps_before`, after
    which the job hangs and every collector repeats its rank's last step; rank `slow_last`
    had a transient slowdown (2x) in that last step."""
    rng = np.random.default_rng(0)
    share = np.array([1.0, 0.5, 0.4, 0.1])[:, None, None]  # step_time, then its sections
    sec = step_s * share * np.exp(rng.normal(0, 0.02, (4, machines, steps_before)))
    sec[:, slow_last, -1] *= 2.0
    last = np.minimum(np.floor(np.arange(duration) / step_s).astype(int) - 1, steps_before - 1)
    values = np.where(last >= 0, sec[:, :, np.maximum(last, 0)], np.nan).astype(np.float32)
    return Grid(values, list(STEP_METRICS), [f"node{i:02d}" for i in range(machines)], start=0.0)


def test_step_times_repeated_through_a_hang_are_stale_and_not_scored():
    grid = _hung_steps()  # step 29, the last, ends at 240 s and is repeated from then on
    kept = without_stale_steps(grid, 3.0).values  # stale after max(3 x 8 s, 30 s) = 30 s
    assert np.isfinite(kept[:, :, 240 + 30]).all() and np.isnan(kept[:, :, 240 + 31 :]).all()
    assert np.isfinite(kept[:, :, 8:240]).all()  # steps still coming: nothing blanked
    np.testing.assert_array_equal(without_stale_steps(grid, 0.0).values, grid.values, strict=True)
    # The rank whose last step was slow: declared on stale values, not on fresh ones.
    assert [a.machine for a in detect(grid, DetectConfig(), tuning=Tuning(stale_steps=0.0)).alerts] == ["node03"]
    assert detect(grid, DetectConfig()).alerts == []


def test_step_average_does_not_copy_a_burst_into_a_dropped_sample():
    t = np.arange(50)
    v = np.repeat(np.where(t % 10 == 3, 200.0, 1.0)[None, None], 4, axis=1).astype(np.float32)
    v[0, 0, 24] = np.nan  # dropped right after machine 0's burst at 23
    mean = step_average(v, 10, 3, ["net_rx_bytes"])
    np.testing.assert_allclose(mean[0, 0], mean[0, 1], equal_nan=True)  # every step mean: 1 burst + 9 x 1
    np.testing.assert_allclose(mean[0, 1, 9:], (200 + 9) / 10, rtol=1e-6)
