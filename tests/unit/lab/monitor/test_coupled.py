"""Physics invariants of the coupled generator, checked against expectations derived from
the model (synchronous steps, sensors as averages and rates), not against its own output."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from megatron_rl.monitor.cli import main
from megatron_rl.monitor.trace import STEP_METRICS, metric_order
from megatron_rl_lab.monitor.coupled import COUPLED_FAULT_KINDS, CoupledConfig, generate_coupled


def _series(trace, metric: str) -> np.ndarray:
    return trace.grid.values[trace.grid.metrics.index(metric)]


def _faulty(trace) -> tuple[int, int]:
    label = trace.labels[0]
    return trace.grid.machines.index(label.machine), int(label.start)


def test_fault_free_has_no_labels_and_a_complete_grid():
    st = generate_coupled(CoupledConfig(machines=8, seed=3))
    assert st.labels == [] and st.stragglers == []
    g = st.grid
    assert g.values.shape == (len(g.metrics), 8, 900) and g.values.dtype == np.float32
    assert g.metrics == metric_order(g.metrics) and not set(STEP_METRICS) & set(g.metrics)
    assert {"net_rx_bytes", "net_tx_bytes", "nvlink_bandwidth", "pfc_tx_packets"} <= set(g.metrics)
    assert 0.001 < np.isnan(g.values).mean() < 0.05  # dropped samples, gaps: some, not many


def test_same_seed_same_grid_and_other_seed_differs():
    a = generate_coupled(CoupledConfig(machines=8, seed=11, fault="hang"))
    b = generate_coupled(CoupledConfig(machines=8, seed=11, fault="hang"))
    c = generate_coupled(CoupledConfig(machines=8, seed=12, fault="hang"))
    np.testing.assert_array_equal(a.grid.values, b.grid.values)
    assert a.labels == b.labels
    assert not np.array_equal(np.nan_to_num(a.grid.values), np.nan_to_num(c.grid.values))


@pytest.mark.parametrize("kind", COUPLED_FAULT_KINDS)
def test_every_kind_is_labelled_in_the_first_half_with_metrics_in_the_grid(kind):
    st = generate_coupled(CoupledConfig(machines=6, seed=2, fault=kind))
    (label,) = st.labels
    assert label.kind == kind and 120 <= label.start <= 420 and label.end == 900
    assert label.metrics and set(label.metrics) <= set(st.grid.metrics)


def test_straggler_lowers_everyone_elses_duty_and_stays_busier_itself():
    """Coupling: the others wait for the slow machine (idle in the gather), so their duty
    falls against the same job without the fault; the straggler is busy for longer."""
    cfg = dict(machines=16, seed=4, distractors=False)
    slow = generate_coupled(CoupledConfig(fault="straggler_slow", **cfg))
    free = generate_coupled(CoupledConfig(step_metrics=True, **cfg))
    m, start = _faulty(slow)
    after = slice(start + 30, None)
    duty_slow, duty_free = _series(slow, "gpu_duty_cycle")[:, after], _series(free, "gpu_duty_cycle")[:, after]
    others = np.delete(np.arange(16), m)
    assert np.nanmean(duty_slow[others]) < np.nanmean(duty_free[others]) - 1.0
    assert np.nanmean(duty_slow[m]) > np.nanmean(duty_slow[others]) + 1.0
    # and every step got longer for everyone
    assert np.nanmean(_series(slow, "step_time")[:, after]) > np.nanmean(_series(free, "step_time")[:, after])


def test_link_half_runs_transfers_at_40_to_60_percent_of_comparable_peers():
    """During its parameter transfers the machine's NVLink rate is its link factor times
    peak; peers of the same hardware group (same pre-fault peak) still reach peak."""
    for seed in range(3):
        st = generate_coupled(CoupledConfig(machines=16, seed=seed, fault="link_half", distractors=False))
        m, start = _faulty(st)
        v = _series(st, "nvlink_bandwidth")
        before, after = np.nanmax(v[:, :start], 1), np.nanmax(v[:, start + 5 :], 1)
        same_group = np.abs(before / before[m] - 1) < 0.05
        same_group[m] = False
        assert 0.38 <= after[m] / before[m] <= 0.7
        assert 0.35 <= after[m] / np.median(after[same_group]) <= 0.7


def test_nic_degraded_halves_both_directions_during_transfers():
    st = generate_coupled(CoupledConfig(machines=12, seed=5, fault="nic_degraded", distractors=False))
    m, start = _faulty(st)
    for metric in ("net_rx_bytes", "net_tx_bytes"):
        peak = np.nanmax(_series(st, metric)[:, start + 5 :], 1)
        assert 0.38 <= peak[m] / np.median(np.delete(peak, m)) <= 0.62


def test_hang_stalls_the_job_and_stops_the_step_metrics():
    """Nothing finishes after a hang: the step metrics repeat the last finished step on
    every machine, tensor work and traffic stop everywhere, the hung GPU reads busy."""
    st = generate_coupled(CoupledConfig(machines=8, seed=6, fault="hang", step_metrics=True, distractors=False))
    m, start = _faulty(st)
    late = slice(start + 60, None)
    step = _series(st, "step_time")[:, late]
    assert np.all(np.nanmax(step, 1) == np.nanmin(step, 1))
    assert np.nanmean(_series(st, "gpu_tensor_activity")[:, late]) < 5
    assert np.nanmax(_series(st, "nvlink_bandwidth")[:, late]) < 1e10
    assert np.nanmean(_series(st, "gpu_duty_cycle")[m, late]) > 95


def test_section_times_follow_the_synchronous_physics():
    """sync_time and step_time end in a collective that everyone starts together: equal
    across ranks up to timer noise. rollout_time is each rank's own generation and differs;
    train_time absorbs the wait for the slowest rollout, so their sum is equal again."""
    st = generate_coupled(CoupledConfig(machines=8, seed=7, step_metrics=True, distractors=False))
    vals = {k: _series(st, k)[:, 60:] for k in STEP_METRICS}
    # Samplers read at different phases, so near a step's end some ranks already report
    # the new step; compare the seconds where every rank reports the same step.
    same_step = np.ptp(vals["step_time"], 0) < 0.05
    assert same_step.mean() > 0.5
    across = {k: np.std(v[:, same_step], 0) for k, v in vals.items()}
    assert across["sync_time"].max() < 0.01 and across["step_time"].max() < 0.02
    assert np.std((vals["rollout_time"] + vals["train_time"])[:, same_step], 0).max() < 0.02
    assert np.median(across["rollout_time"]) > 0.1 and np.median(across["train_time"]) > 0.1


def test_config_validation_names_the_field_and_what_is_allowed():
    for kwargs, field in (
        (dict(machines=2), "machines"),
        (dict(machines=2000), "machines"),
        (dict(duration_s=10), "duration_s"),
        (dict(fault="meteor"), "fault"),
        (dict(step_period_s=(3.0, 9.0)), "step_period_s"),
        (dict(step_period_s=(12.0, 6.0)), "step_period_s"),
    ):
        with pytest.raises(ValueError, match=rf"^{field}: .*allowed"):
            CoupledConfig(**kwargs)


def test_128_machines_generate_with_one_labelled_fault():
    st = generate_coupled(CoupledConfig(machines=128, seed=1, fault="link_half", step_metrics=True))
    assert len(st.grid.machines) == 128 and len(st.labels) == 1 and st.labels[0].kind == "link_half"


def test_cli_rejects_an_unknown_generator_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "--generator", "bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "invalid choice: 'bogus'" in err[-1]


def test_cli_synth_writes_a_coupled_trace(tmp_path):
    import json

    out = tmp_path / "c.csv"
    assert (
        main(
            [
                "synth",
                "--generator",
                "coupled",
                "--out",
                str(out),
                "--machines",
                "4",
                "--fault",
                "pfc_storm",
                "--duration-s",
                "300",
                "--seed",
                "1",
            ]
        )
        == 0
    )
    labels = json.loads((tmp_path / "c.labels.json").read_text())
    assert labels[0]["kind"] == "pfc_storm" and out.stat().st_size > 0
    assert main(["synth", "--generator", "coupled", "--out", str(out), "--fault", "gpu_drop"]) == 2


def test_evaluation_builds_coupled_traces_and_tallies_their_kinds():
    from megatron_rl_lab.monitor.evaluate import EvalConfig, Outcome, tally

    ec = EvalConfig(generator="coupled", machines=(4,), faulty_per_cell=1, fault_free_per_size=1)
    assert ec.kinds == COUPLED_FAULT_KINDS and EvalConfig().kinds != COUPLED_FAULT_KINDS
    scen = ec.scenarios()
    assert len(scen) == 1 + len(COUPLED_FAULT_KINDS) and all(isinstance(c, CoupledConfig) for c in scen)
    with pytest.raises(ValueError, match="^generator: 'nope'; allowed: synth, coupled"):
        EvalConfig(generator="nope")
    cfg = scen[-1]
    st = generate_coupled(replace(cfg, duration_s=300))
    t = tally([Outcome(cfg, st.labels, {("m", 1.0): []})], "m", 1.0)
    assert t[cfg.fault].fn == 1
