"""The detector on hand-built grids: right machine and metric, quiet when healthy,
continuity, missing data, churn, priority and the two candidate rules."""

import json
from dataclasses import fields

import numpy as np
import pytest

from megatron_rl.monitor.detect import Alert, DetectConfig, declare, detect, median_distance, score_grid
from megatron_rl.monitor.tuning import Tuning

CFG = DetectConfig(threshold=5.0, continuity_s=120.0)


def test_finds_injected_fault_in_right_machine_and_metric(make_grid):
    grid = make_grid(faults=[(5, "gpu_power", 100, 600, -8.0)])
    alerts = detect(grid, CFG).alerts
    assert [(a.machine, a.metric) for a in alerts] == [("node05", "gpu_power")]
    a = alerts[0]
    assert 100 - CFG.window_s <= a.first_seen <= 100 + CFG.window_s  # first window touching the fault
    assert a.declared_at - a.first_seen >= CFG.continuity_s
    assert a.declared_at <= 100 + CFG.continuity_s + 3 * CFG.window_s  # not much later than needed
    assert a.score > CFG.threshold


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quiet_on_fault_free_trace(make_grid, seed):
    grid = make_grid(machines=32, seed=seed)
    assert detect(grid, CFG).alerts == []


SHAPE_ONLY = Tuning(peer_scores=False)


def test_short_spike_is_not_declared_but_a_long_one_is(make_grid):
    # The window-shape score alone: the peer level score averages over 32 s and so keeps
    # a 60 s spike a candidate for ~90 s (tested in test_peers.py).
    short = make_grid(faults=[(3, "gpu_power", 200, 260, -10.0)])  # 60 s < continuity 120 s
    assert detect(short, CFG, tuning=SHAPE_ONLY).alerts == []
    sc = score_grid(short, CFG, tuning=SHAPE_ONLY)
    assert np.nanmax(sc.z[2, 3]) > CFG.threshold  # it was a candidate, continuity rejected it
    long = make_grid(faults=[(3, "gpu_power", 200, 400, -10.0)])
    assert [a.machine for a in detect(long, CFG).alerts] == ["node03"]


def test_strict_continuity_breaks_on_a_gap_tolerant_one_does_not(make_grid):
    # Fault on 200-300 and 316-600: a 16 s hole (two windows) in the middle.
    grid = make_grid(faults=[(7, "gpu_duty_cycle", 200, 300, -8.0), (7, "gpu_duty_cycle", 316, 600, -8.0)])
    # Window-shape score only: the peer level score (32 s average) would bridge the hole.
    cfg = DetectConfig(threshold=5.0, continuity_s=150.0)
    strict = Tuning(max_gap_s=0.0, min_fraction=1.0, peer_scores=False)
    tolerant = Tuning(max_gap_s=24.0, min_fraction=0.75, peer_scores=False)
    first_strict = detect(grid, cfg, tuning=strict).alerts[0]
    first_tolerant = detect(grid, cfg, tuning=tolerant).alerts[0]
    assert first_strict.first_seen >= 300  # the run had to start again after the hole
    assert first_tolerant.first_seen < 216


def test_priority_order_decides_the_reported_metric(make_grid):
    # Same machine odd in gpu_power and (weaker) in cpu_util: cpu_util has priority.
    grid = make_grid(faults=[(2, "gpu_power", 100, 600, -20.0), (2, "cpu_util", 100, 600, 8.0)])
    assert [(a.machine, a.metric) for a in detect(grid, CFG).alerts] == [("node02", "cpu_util")]


def test_missing_metrics_are_tolerated(make_grid):
    grid = make_grid(faults=[(4, "gpu_power", 100, 600, -8.0)])
    grid.values[0, :, :] = np.nan  # cpu_util absent everywhere
    grid.values[1, 4, :] = np.nan  # the faulty machine has no duty cycle at all
    grid.values[2, 9, :] = np.nan  # another machine has no power reading
    sc = score_grid(grid, CFG)
    assert np.isnan(sc.z[0]).all() and np.isnan(sc.z[1, 4]).all() and np.isnan(sc.z[2, 9]).all()
    assert [(a.machine, a.metric) for a in declare(sc, CFG).alerts] == [("node04", "gpu_power")]


def test_machines_joining_and_leaving_are_not_faults(make_grid):
    grid = make_grid(machines=12, faults=[(1, "gpu_power", 150, 600, -8.0)])
    grid.values[:, 10, :250] = np.nan  # joins at 250 s
    grid.values[:, 11, 300:] = np.nan  # leaves at 300 s
    alerts = detect(grid, CFG).alerts
    assert [a.machine for a in alerts] == ["node01"]


def test_nans_and_short_gaps_do_not_cause_alerts(make_grid):
    grid = make_grid(machines=24, seed=3, faults=[(6, "gpu_duty_cycle", 100, 600, -8.0)])
    rng = np.random.default_rng(0)
    grid.values[rng.random(grid.values.shape) < 0.03] = np.nan
    assert [a.machine for a in detect(grid, CFG).alerts] == ["node06"]


def test_too_few_machines_gives_no_scores(make_grid):
    grid = make_grid(machines=2, faults=[(0, "gpu_power", 0, 600, -20.0)])
    assert np.isnan(score_grid(grid, CFG).z).all()
    assert detect(grid, CFG).alerts == []


def test_top1_rule_and_already_declared_machines(make_grid):
    grid = make_grid(faults=[(5, "gpu_power", 100, 600, -12.0), (9, "gpu_power", 100, 600, -6.0)])
    # Two of 16 machines off together on one metric are a crowd (crowd_machines): counted
    # as two outliers here, to test the candidate rules.
    top1, pairs = DetectConfig(threshold=5.0, continuity_s=120.0, mode="top1"), Tuning(crowd_machines=3)
    first = detect(grid, top1, tuning=pairs).alerts
    assert [a.machine for a in first] == ["node05", "node09"]  # node09 follows once node05 is out
    assert first[1].declared_at > first[0].declared_at
    again = detect(grid, top1, already={"node05", "node09"}, tuning=pairs).alerts
    assert again == []
    both = detect(grid, DetectConfig(threshold=5.0, continuity_s=120.0, mode="any"), tuning=pairs).alerts
    assert sorted(a.machine for a in both) == ["node05", "node09"]
    # By default the pair is a crowd from 100 s on, in every window where both are above
    # the threshold: the price of not declaring a rack or stage that differs together.
    pair = detect(grid, DetectConfig(threshold=5.0, continuity_s=120.0, mode="any")).alerts
    assert [a.machine for a in pair] == []


def test_median_distance_matches_brute_force():
    rng = np.random.default_rng(0)
    rec = rng.normal(size=(3, 8, 11)).astype(np.float32)  # [windows, window, machines]
    rec[1, :, 4] = np.nan  # machine left out of one window
    got = median_distance(rec)
    for w in range(3):
        rows = [i for i in range(11) if not np.isnan(rec[w, 0, i])]
        med = np.median(rec[w][:, rows], axis=1)
        for i in range(11):
            want = np.nan if i not in rows else np.abs(rec[w, :, i] - med).mean()
            np.testing.assert_allclose(got[w, i], want, rtol=1e-5, equal_nan=True)


def test_alert_json_has_exactly_the_spec_fields():
    a = Alert("node01", "gpu_power", 100.0, 348.0, 7.123456)
    assert json.loads(a.to_json()) == {
        "machine": "node01",
        "metric": "gpu_power",
        "first_seen": 100.0,
        "declared_at": 348.0,
        "score": 7.123,
    }


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"threshold": 0}, "threshold"),
        ({"min_fraction": 1.5}, "min_fraction"),
        ({"mode": "best"}, "mode"),
        ({"window_s": 1.0}, "window_s"),
        ({"window_s": 4.0}, "window_s"),
        ({"min_machines": 2}, "min_machines"),
    ],
)
def test_config_errors_name_the_field(kwargs, word):
    make = DetectConfig if kwargs.keys() <= {f.name for f in fields(DetectConfig)} else Tuning
    with pytest.raises(ValueError, match=word):
        make(**kwargs)
