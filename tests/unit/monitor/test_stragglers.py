"""Step and section times: recorded by the trainer, forward-filled per second, counted in steps."""

from dataclasses import replace

import numpy as np
import pytest

from megatron_rl.monitor.collect import Collector
from megatron_rl.monitor.config import DetectConfig, OnlineConfig
from megatron_rl.monitor.detect import continuity, detect, score_grid, step_period
from megatron_rl.monitor.online import OnlineMonitor
from megatron_rl.monitor.stragglers import straggler_span, trailing_median
from megatron_rl.monitor.trace import STEP_METRICS
from megatron_rl.monitor.tuning import TUNING, Tuning
from megatron_rl.monitor.windows import Grid
from megatron_rl_lab.monitor.coupled import CoupledConfig, generate_coupled
from megatron_rl_lab.monitor.synth import SynthConfig, generate


def step_grid(machines=16, duration=1200, step_s=60.0, slow=(), seed=0, noise=0.02) -> Grid:
    """Step metrics only, one value per `step_s` step, repeated every second until the next
    step ends; each slow entry is (machine, first_step, last_step, factor); `noise`: the
    per-rank, per-step log-normal spread of each section."""
    rng = np.random.default_rng(seed)
    n_steps = int(duration // step_s)
    common = 1 + 0.1 * rng.standard_normal(n_steps)  # the job's pace changes step to step
    share = np.array([0.5, 0.4, 0.1])
    sec = share[:, None, None] * step_s * common * np.exp(rng.normal(0, noise, (3, machines, n_steps)))
    for i, first, last, factor in slow:
        sec[:, i, first : last + 1] *= factor
    steps = np.concatenate([sec.sum(0, keepdims=True), sec])  # step_time, then the sections
    last_done = np.floor(np.arange(duration) / step_s).astype(int) - 1  # finished step at each second
    values = np.where(last_done >= 0, steps[:, :, np.maximum(last_done, 0)], np.nan).astype(np.float32)
    return Grid(values, list(STEP_METRICS), [f"node{i:02d}" for i in range(machines)], start=0.0)


def test_collector_repeats_the_last_steps_times_at_every_sample():
    c = Collector("h", sources=[], clock=iter(range(100)).__next__)
    assert c.sample() == {}
    c.record_step_time(10.0, {"rollout_time": 6.0, "train_time": 3.5, "sync_time": None})
    assert c.sample() == c.sample() == {"step_time": 10.0, "rollout_time": 6.0, "train_time": 3.5}
    with pytest.raises(ValueError, match="rollout_time, train_time, sync_time"):
        c.record_step_time(1.0, {"backward_time": 1.0})


def test_online_monitor_hands_section_times_to_its_collector(tmp_path):
    col = Collector("h", sources=[], clock=iter(range(100)).__next__)
    mon = OnlineMonitor(OnlineConfig(enabled=True, write_traces=False), tmp_path, collector=col, denoiser=None)
    mon.on_step(12.0, sections={"train_time": 4.0, "sync_time": 1.0})
    assert col.sample() == {"step_time": 12.0, "train_time": 4.0, "sync_time": 1.0}


def test_rank_at_0_8x_speed_is_found_within_a_few_steps():
    grid = step_grid(slow=[(5, 5, 19, 1.25)])  # from step 5 (ends at 360 s) its sections take 1.25x
    alerts = detect(grid, DetectConfig()).alerts
    assert [a.machine for a in alerts] == ["node05"]
    shown = 6 * 60  # the first slow step's value appears when that step ends
    assert alerts[0].declared_at - shown <= 4 * 60  # continuity: max(120 s, 3 steps of 60 s)


def test_two_slow_steps_are_not_a_straggler_but_would_be_without_step_continuity():
    grid = step_grid(slow=[(3, 6, 7, 1.5)])  # two 60 s steps at 1.5x, then normal again
    assert detect(grid, DetectConfig()).alerts == []
    assert [a.machine for a in detect(grid, DetectConfig(), tuning=Tuning(straggler_steps=1)).alerts] == ["node03"]


def test_continuity_counts_steps_only_for_step_metrics():
    grid = step_grid()
    scores = score_grid(grid, DetectConfig())
    assert scores.step_period_s == pytest.approx(60.0, rel=0.1)
    extra = Grid(np.ones((1, 16, 1200), np.float32), ["gpu_power"], grid.machines, 0.0)
    scores.metrics = scores.metrics + extra.metrics
    need = continuity(scores, DetectConfig(), Tuning(straggler_steps=3, follow_step=False))
    assert need[:4] == pytest.approx(3 * scores.step_period_s) and need[4] == DetectConfig().continuity_s
    # Following the step (the default), per-second metrics need continuity_steps steps too.
    need = continuity(scores, DetectConfig(), Tuning(straggler_steps=3, continuity_steps=4))
    assert need[:4] == pytest.approx(3 * scores.step_period_s)
    assert need[4] == pytest.approx(4 * scores.step_period_s)
    with pytest.raises(ValueError, match="straggler_steps"):
        Tuning(straggler_steps=0)


def test_synthetic_straggler_is_1_1_to_1_5x_its_peers_and_labelled_with_its_sections():
    st = generate(
        SynthConfig(
            machines=16,
            duration_s=600,
            seed=3,
            fault="straggler",
            transient_rate=0.0,
            persistent_stragglers=0,
            fault_start=(100.0, 100.0),
        )
    )
    (lab,) = st.labels
    assert lab.metrics[0] == "step_time" and set(lab.metrics[1:]) <= set(STEP_METRICS[1:])
    g, i = st.grid, st.grid.machines.index(lab.machine)
    k = g.metrics.index(lab.metrics[-1])
    ratio = np.nanmedian(g.values[k, i, 200:] / np.nanmedian(g.values[k, :, 200:], 0))
    assert 1.05 < ratio < 1.6
    assert np.isnan(g.values[k, :, 0]).all()  # absent until the first step ends
    healthy = generate(SynthConfig(machines=8, duration_s=300, seed=3))
    assert healthy.grid.metrics == generate(SynthConfig(machines=8, duration_s=300, seed=3)).grid.metrics
    assert "step_time" not in healthy.grid.metrics  # off by default: earlier traces unchanged


def test_step_period_of_a_synthetic_trace_is_its_step_length():
    st = generate(SynthConfig(machines=8, duration_s=600, seed=1, step_metrics=True, step_period_s=(60.0, 60.0)))
    assert step_period(st.grid) == pytest.approx(60.0, rel=0.1)


def test_a_run_mixing_step_and_per_second_metrics_needs_the_step_continuity():
    steps = step_grid(slow=[(3, 4, 5, 1.5)])  # two slow steps, shown from 300 s to 420 s
    rng = np.random.default_rng(1)
    cpu = (30 + rng.normal(0, 1, (1, 16, 1200))).astype(np.float32)
    cpu[0, 3, 400:430] += 30  # then half a minute of high CPU on the same machine
    grid = Grid(np.concatenate([cpu, steps.values]), ["cpu_util"] + steps.metrics, steps.machines, 0.0)
    # The mixing rule alone, without step averaging: with it (the default) the 30 s of
    # high CPU are averaged over a 60 s step, their footprint grows by a step, and the
    # joined run then does span 3 steps.
    fixed = Tuning(follow_step=False)
    assert detect(grid, DetectConfig(), tuning=fixed).alerts == []  # ~165 s in all (with the 32 s CPU level): < 3 steps
    assert [a.machine for a in detect(grid, DetectConfig(), tuning=replace(fixed, straggler_steps=2)).alerts] == [
        "node03"
    ]


def test_trailing_median_needs_most_of_its_span():
    x = np.array([[1.0, 5.0, 2.0, np.nan, 4.0, 3.0]])
    # span 3, at least 75 % of it (2.25 values): only the third position has three.
    np.testing.assert_array_equal(trailing_median(x, 3), [[np.nan, np.nan, 2.0, np.nan, np.nan, np.nan]])
    np.testing.assert_array_equal(trailing_median(x, 3, min_present=0.5), [[np.nan, 3.0, 2.0, 3.5, 3.0, 3.5]])


def test_straggler_span_is_the_longer_of_its_seconds_and_its_steps():
    cfg = DetectConfig()  # 96 s or 5 steps, in 8 s windows
    assert straggler_span(cfg, TUNING, 8.0) == 12 and straggler_span(cfg, TUNING, None) == 12
    assert straggler_span(cfg, TUNING, 60.0) == 38  # 300 s / 8 s, rounded


def test_rank_at_0_8x_on_coupled_traces_is_found_only_by_the_median_over_steps():
    """The coupled generator's straggler (this seed: 0.8x from 288 s; its rollout varies 7 %
    per step): missed by the window score, found by the median over steps."""
    st = generate_coupled(CoupledConfig(machines=32, seed=100001, fault="straggler_slow", step_metrics=True))
    (lab,) = st.labels
    on = detect(st.grid, DetectConfig()).alerts
    assert [a.machine for a in on] == [lab.machine] and on[0].metric == "rollout_time"
    off = detect(st.grid, DetectConfig(), tuning=Tuning(straggler_score=False)).alerts
    assert lab.machine not in [a.machine for a in off]


def _channel(slow, noise=0.07, seed=0, **tuning):
    """Straggler z [step metrics, machines, windows] of 32 ranks with 8 s steps."""
    grid = step_grid(machines=32, duration=900, step_s=8.0, slow=slow, seed=seed, noise=noise)
    scores = score_grid(grid, DetectConfig(), tuning=Tuning(**tuning))
    return scores.straggler.z


def test_a_rank_25_percent_slower_scores_above_the_threshold_once_its_median_moves():
    z = _channel([(5, 30, 120, 1.25)])  # slow from step 30: shown from 248 s, window 31
    th = TUNING.straggler_threshold
    assert np.nanmin(z[1, 5, 31 + 12 :]) > th  # rollout_time, once the slow steps are most of the span
    assert np.nanmax(np.delete(z, 5, 1)) < th


def test_short_transients_fast_ranks_and_a_few_percent_do_not_score():
    # A 32 s slowdown at 2x (a window under half of the 96 s span) and a rank 20 % fast, 7 % noise:
    z = _channel([(7, 40, 43, 2.0), (9, 20, 120, 0.8)])
    assert np.nanmax(z[:, 7]) < TUNING.straggler_threshold and np.nanmax(z[:, 9]) <= 0.0
    # 6 % slower with 1 % noise: far outside the peers' spread, under straggler_min_slowdown.
    z = _channel([(4, 10, 120, 1.06)], noise=0.01)
    assert np.nanmax(z[:, 4]) <= 0.0
    ungated = _channel([(4, 10, 120, 1.06)], noise=0.01, straggler_min_slowdown=0.0, straggler_low_quantile=None)
    assert np.nanmin(ungated[1, 4, 30:]) > TUNING.straggler_threshold


def test_two_bursts_that_carry_the_median_do_not_score():
    """Two 2x slowdowns of 2 and 3 steps, 5 steps apart: with the windows they straddle,
    over half of the 12-window span, enough for the median; the 30th percentile
    (`straggler_low_quantile`) stays at the peers' pace. A rank slow in every step of the
    span passes both gates (the 25 % test above)."""
    bursts = [(7, 40, 41, 2.0), (7, 47, 49, 2.0)]
    on_the_median = _channel(bursts, straggler_low_quantile=None)
    assert np.nanmax(on_the_median[:, 7]) > TUNING.straggler_threshold
    assert np.nanmax(_channel(bursts)[:, 7]) <= 0.0
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"straggler_low_quantile must be null or in \[0, 1\]"):
            Tuning(straggler_low_quantile=bad)
