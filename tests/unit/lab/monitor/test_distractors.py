"""The harder synthetic traces: new fault kinds and distractors that are not faults."""

import numpy as np

from megatron_rl_lab.monitor.distractors import job_wide_load, pipeline_phases, sensor_spikes
from megatron_rl_lab.monitor.synth import SynthConfig, generate

CLEAN = dict(churn=False, drop_frac=0, nan_frac=0, transient_rate=0.0, persistent_stragglers=0)


def _fault(kind, **kw):
    st = generate(SynthConfig(machines=16, duration_s=900, seed=5, fault=kind, **CLEAN, **kw))
    (lab,) = st.labels
    return st.grid, st.grid.machines.index(lab.machine), int(lab.start)


def test_link_partial_halves_one_links_bandwidth_relative_to_peers():
    g, i, start = _fault("link_partial")
    k = g.metrics.index("nvlink_bandwidth")
    ratio = g.values[k, i, start + 30 :].mean() / np.delete(g.values[k], i, 0)[:, start + 30 :].mean()
    assert 0.35 < ratio < 0.65
    for other in ("gpu_power", "cpu_util"):  # only the link moves
        ko = g.metrics.index(other)
        r = g.values[ko, i, start:].mean() / np.delete(g.values[ko], i, 0)[:, start:].mean()
        assert 0.85 < r < 1.15  # per-machine offsets and sampler phase only


def test_gpu_flap_idles_about_half_the_time_in_10_to_60_s_periods():
    g, i, start = _fault("gpu_flap")
    k = g.metrics.index("gpu_power")
    smooth = lambda x: np.convolve(x, np.ones(5) / 5, mode="same")  # noqa: E731  over the step's phases
    peers = smooth(np.median(np.delete(g.values[k], i, 0), 0))
    idle = (smooth(g.values[k, i]) < 0.5 * peers)[start + 5 : -5]
    assert 0.3 < idle.mean() < 0.7
    edges = np.flatnonzero(np.diff(idle.astype(int)))
    assert len(edges) >= 4 and np.median(np.diff(edges)) >= 8


def test_distractors_are_job_wide_or_short_and_deterministic():
    a = generate(SynthConfig(machines=32, seed=3, distractors=True))
    b = generate(SynthConfig(machines=32, seed=3, distractors=True))
    plain = generate(SynthConfig(machines=32, seed=3))
    np.testing.assert_array_equal(a.grid.values, b.grid.values)
    assert not np.array_equal(np.nan_to_num(a.grid.values), np.nan_to_num(plain.grid.values))
    assert a.labels == []


def test_pipeline_phases_split_machines_into_stages_in_rank_order():
    ph = pipeline_phases(np.random.default_rng(0), 64)
    assert np.all(np.diff(ph) >= 0) and 2 <= len(np.unique(ph)) <= 8 and ph[0] == 0 and ph.max() < 1


def test_job_wide_load_moves_every_machine_by_the_same_share():
    t = np.arange(600.0)
    act, comm = np.full((8, 600), 0.7), np.full((8, 600), 0.3)
    job_wide_load(np.random.default_rng(1), act, comm, t)
    assert np.ptp(act, axis=0).max() < 1e-12 and act.min() < 0.7
    np.testing.assert_allclose(act + comm, 1.0)


def test_sensor_spikes_are_short_and_spare_the_avoided_machine():
    t = np.arange(900.0)
    m = {"gpu_power": np.full((16, 900), 500.0), "cpu_util": np.full((16, 900), 50.0)}
    sensor_spikes(np.random.default_rng(2), m, t, avoid={3})
    changed = np.concatenate([v != v.flat[0] for v in m.values()])
    assert changed.any() and not changed[[3, 19]].any()
    assert changed.sum(axis=1).max() <= 11 * 3
