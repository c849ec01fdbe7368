"""Synthetic traces carry what they claim; evaluation matching and baselines behave."""

import numpy as np
import pytest

from megatron_rl.monitor.detect import Alert, DetectConfig, declare
from megatron_rl.monitor.trace import validate
from megatron_rl.monitor.tuning import Tuning
from megatron_rl.monitor.windows import to_grid
from megatron_rl_lab.monitor.baseline import mahalanobis_scores, zscore_scores
from megatron_rl_lab.monitor.evaluate import EvalConfig, Method, Tally, run_all, tally, tune
from megatron_rl_lab.monitor.synth import FAULT_KINDS, SynthConfig, generate


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # step metrics before the first step ends
@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_fault_moves_its_metrics_on_its_machine_after_its_start(kind):
    st = generate(
        SynthConfig(
            machines=12,
            duration_s=600,
            seed=2,
            fault=kind,
            churn=False,
            drop_frac=0,
            nan_frac=0,
            transient_rate=0.0,
            persistent_stragglers=0,
        )
    )
    (lab,) = st.labels
    g = st.grid
    i, start = g.machines.index(lab.machine), int(lab.start)
    for metric in lab.metrics:
        k = g.metrics.index(metric)
        others = np.delete(g.values[k], i, axis=0)
        gap_after = np.abs(np.nanmedian(g.values[k, i, start + 200 :] - np.nanmedian(others[:, start + 200 :], 0)))
        gap_before = np.abs(np.nanmedian(g.values[k, i, :start] - np.nanmedian(others[:, :start], 0)))
        assert gap_after > 3 * gap_before + 1e-6, (kind, metric)


def test_fault_free_trace_has_no_labels_and_every_defect_kind_over_seeds():
    sts = [generate(SynthConfig(machines=8, duration_s=900, seed=s)) for s in range(10)]
    assert all(st.labels == [] for st in sts)
    reps = [validate(st.to_trace()) for st in sts]
    assert all(r.nan_values > 0 for r in reps)  # explicit NaN rows
    assert any(r.joined for r in reps) and any(r.left for r in reps) and any(r.partial_metrics for r in reps)
    g = to_grid(sts[0].to_trace())  # jittered timestamps land back on their seconds
    assert g.values.shape == sts[0].grid.values.shape


def test_unknown_fault_kind_lists_the_allowed_ones():
    with pytest.raises(ValueError, match="gpu_drop"):
        SynthConfig(fault="meteor")


def test_tally_matches_alerts_to_labels():
    st = generate(SynthConfig(machines=8, duration_s=600, seed=0, fault="cpu_spike"))
    (lab,) = st.labels
    t = Tally()
    t.add(
        [
            Alert(lab.machine, "cpu_util", lab.start, lab.start + 250, 9.0),  # true positive
            Alert(lab.machine, "cpu_util", 0, lab.start - 1, 9.0),  # before the fault: false alarm
            Alert("someone_else", "gpu_power", 0, 500, 9.0),
        ],
        st.labels,
    )  # false alarm
    assert (t.tp, t.fp, t.fn, t.delays, t.metric_right) == (1, 2, 0, [250.0], 1)
    assert t.prf() == pytest.approx((1 / 3, 1.0, 0.5))
    missed = Tally()
    missed.add([], st.labels)
    assert (missed.tp, missed.fn) == (0, 1) and missed.prf()[2] == 0.0


def test_baselines_score_an_outlier_highest(make_grid):
    grid = make_grid(machines=16, duration=120, faults=[(3, "cpu_util", 0, 120, 15.0)])
    z = zscore_scores(grid)
    assert z.z.shape == (3, 16, 120) and np.all(np.nanargmax(z.z[0], axis=0) == 3)
    m = mahalanobis_scores(grid)
    assert m.metrics == ["mahalanobis"] and np.mean(np.nanargmax(m.z[0], axis=0) == 3) > 0.95
    assert [a.machine for a in declare(m, DetectConfig(threshold=3.0, continuity_s=60)).alerts] == ["node03"]


def test_tuning_and_evaluation_run_end_to_end():
    ec = EvalConfig(kinds=("cpu_spike",), machines=(8,), faulty_per_cell=1, fault_free_per_size=1, duration_s=600)
    from megatron_rl.monitor.detect import score_grid

    # The mechanics of tuning, on the per-metric scores: at threshold 4 the joint GPU
    # score (a robust z like any other, meant for 6.5) raises a healthy machine here.
    cfg, tuning = DetectConfig(continuity_s=120), Tuning(gpu_joint=False)
    m = Method("raw", lambda g: score_grid(g, cfg, tuning=tuning), cfg, (4.0, 1000.0), tuning)
    outcomes = run_all([m], ec)
    assert len(outcomes) == 2 and set(outcomes[0].alerts) == {("raw", 4.0), ("raw", 1000.0)}
    th, f1 = tune(outcomes, m)
    assert (th, f1) == (4.0, 1.0)  # a cpu spike is found; a threshold of 1000 finds nothing
    t = tally(outcomes, "raw", 1000.0)
    assert t["cpu_spike"].fn == 1 and t["machine_hours"] == pytest.approx(8 * 600 / 3600)


def test_report_counts_found_faults_and_false_alarms_per_machine_day():
    from megatron_rl_lab.monitor.evaluate import Outcome, report_rows

    ff = SynthConfig(machines=24, duration_s=3600, seed=1)
    bad = SynthConfig(machines=8, seed=1, fault="gpu_flap")
    lab = generate(SynthConfig(machines=8, duration_s=300, seed=1, fault="gpu_flap", fault_start=(10, 20))).labels
    fa = Alert("node0001", "cpu_util", 0.0, 100.0, 9.0)
    hit = Alert(lab[0].machine, "gpu_power", 20.0, lab[0].start + 90, 9.0)
    rows = report_rows(tally([Outcome(ff, [], {("m", 4.5): [fa]}), Outcome(bad, lab, {("m", 4.5): [hit]})], "m", 4.5))
    flap = next(r for r in rows if r["kind"] == "gpu_flap")
    assert (flap["tp"], flap["fn"], flap["recall"]) == (1, 0, 1.0) and abs(flap["delay_median_s"] - 90) < 1e-6
    free = rows[-1]
    assert free["false_alarms"] == 1 and abs(free["fa_per_machine_day"] - 1.0) < 1e-9  # 1 in 24 machine-hours


def test_eval_config_passes_distractors_to_every_trace():
    sc = EvalConfig(machines=(8,), faulty_per_cell=1, fault_free_per_size=1, distractors=True).scenarios()
    assert sc and all(s.distractors for s in sc) and {"link_partial", "gpu_flap"} <= {s.fault for s in sc}
