"""OnlineMonitor single-process: gather on schedule, detect, write alerts and exclude file."""

import numpy as np

from megatron_rl.monitor.actions import read_alerts, read_exclude
from megatron_rl.monitor.detect import DetectConfig
from megatron_rl.monitor.online import OnlineConfig, OnlineMonitor

FAST = DetectConfig(threshold=5.0, continuity_s=60.0)


class FakeCollector:
    """Hands out pre-made rows: `per_drain` seconds of a whole cluster per drain."""

    def __init__(self, grid, per_drain, machines=None):
        self.grid, self.per_drain, self.t = grid, per_drain, 0
        self.machines = range(len(grid.machines)) if machines is None else machines
        self.step_times = []

    def drain(self):
        g, rows = self.grid, []
        for t in range(self.t, min(self.t + self.per_drain, g.values.shape[-1])):
            for k, metric in enumerate(g.metrics):
                for i in self.machines:
                    rows.append((1000.0 + t, g.machines[i], metric, float(g.values[k, i, t])))
        self.t += self.per_drain
        return rows

    def record_step_time(self, s, sections=None):
        self.step_times.append(s)

    def start(self):
        pass

    def stop(self):
        pass


def monitor(tmp_path, grid, **kw):
    cfg = OnlineConfig(enabled=True, detect_every_steps=3, lookback_s=120.0, detect=FAST, **kw)
    return OnlineMonitor(cfg, tmp_path, collector=FakeCollector(grid, per_drain=40), denoiser=None)


def test_detects_writes_alert_and_exclude_file(tmp_path, make_grid):
    grid = make_grid(machines=10, duration=400, faults=[(4, "gpu_power", 80, 400, -9.0)])
    mon = monitor(tmp_path, grid, stop_on_alert=True).start()
    found = []
    for _ in range(30):
        found += mon.on_step(step_time_s=1.0)
    mon.stop()
    assert [a.machine for a in found] == ["node04"]  # declared once, not again on later runs
    assert mon.stop_requested
    assert [a.machine for a in read_alerts(tmp_path / "monitor" / "alerts.jsonl")] == ["node04"]
    assert read_exclude(tmp_path / "monitor" / "exclude_hosts.txt") == ["node04"]
    assert len(mon.collector.step_times) == 30
    assert 1000 + 80 <= found[0].first_seen < 1000 + 80 + 16  # in trace seconds


def test_healthy_cluster_stays_quiet(tmp_path, make_grid):
    mon = monitor(tmp_path, make_grid(machines=10, duration=400, seed=4))
    assert sum((mon.on_step() for _ in range(30)), []) == []
    assert not (tmp_path / "monitor" / "exclude_hosts.txt").exists() and not mon.stop_requested


def test_gather_is_called_on_schedule_and_only_the_detector_detects(tmp_path, make_grid):
    grid = make_grid(machines=10, duration=400, faults=[(4, "gpu_power", 0, 400, -9.0)])
    calls = []

    def gather(samples):  # what rank 1 sees: it contributes its samples, gets nothing back
        calls.append(len(samples))
        return None

    cfg = OnlineConfig(detect_every_steps=5, detect=FAST, exclude_file=str(tmp_path / "ex.txt"))
    mon = OnlineMonitor(cfg, tmp_path, is_detector=False, gather=gather, collector=FakeCollector(grid, per_drain=40))
    assert sum((mon.on_step() for _ in range(20)), []) == []
    assert len(calls) == 4 and all(n > 0 for n in calls)
    assert not (tmp_path / "ex.txt").exists()


def test_lookback_bounds_memory(tmp_path, make_grid):
    mon = monitor(tmp_path, make_grid(machines=5, duration=400, seed=1))
    for _ in range(30):
        mon.on_step()
    times = np.concatenate([c.timestamps for c in mon._chunks])
    assert times.max() - times.min() <= 120.0 + 40  # lookback plus one drain not yet trimmed


def test_samples_from_other_ranks_are_merged(tmp_path, make_grid):
    from megatron_rl.monitor.trace import Trace

    grid = make_grid(machines=10, duration=400, faults=[(7, "gpu_power", 0, 400, -9.0)])
    other_rank = FakeCollector(grid, per_drain=40, machines=range(5, 10))  # holds the faulty machine

    def gather(samples):  # rank 0's view of a 2-rank gather
        return [samples, Trace.from_rows(other_rank.drain())]

    cfg = OnlineConfig(detect_every_steps=3, lookback_s=120.0, detect=FAST)
    mon = OnlineMonitor(cfg, tmp_path, gather=gather, collector=FakeCollector(grid, 40, machines=range(5)))
    found = sum((mon.on_step() for _ in range(30)), [])
    assert [a.machine for a in found] == ["node07"]


def test_history_grows_with_long_steps_to_hold_a_declarable_run(tmp_path, make_grid):
    mon = OnlineMonitor(
        OnlineConfig(lookback_s=900.0, detect=DetectConfig()),
        tmp_path,
        collector=FakeCollector(make_grid(machines=5, duration=400, seed=1), per_drain=40),
        denoiser=None,
    )
    assert mon.history_s() == 900.0  # no step seen yet
    mon._step_times.extend([10.0] * 5)  # short steps: 80 s peak + 110 s continuity + 10 s < 900 s
    assert mon.history_s() == 900.0
    mon._step_times.clear()
    mon._step_times.extend([230.0, 240.0, 250.0])
    # 240 s steps: the peak over 4 steps (960 s) fills, then 4 steps of continuity (960 s), then a step
    assert mon.history_s() == 4 * 240 + 4 * 240 + 240


def test_history_holds_the_longer_continuity_of_a_large_job(tmp_path, make_grid):
    mon = OnlineMonitor(
        OnlineConfig(lookback_s=100.0, detect=DetectConfig()),
        tmp_path,
        collector=FakeCollector(make_grid(machines=5, duration=400, seed=1), per_drain=40),
        denoiser=None,
    )
    mon._step_times.extend([10.0] * 5)  # the 80 s peak span, 110 s of continuity, a step
    assert mon.history_s() == mon.history_s(machines=128) == 80 + 110 + 10
    assert mon.history_s(machines=1024) == 80 + 200 + 10  # three doublings of 30 s


def test_long_steps_keep_the_longer_history(tmp_path, make_grid):
    mon = monitor(tmp_path, make_grid(machines=5, duration=2000, seed=1))
    mon.collector.per_drain = 120  # 3 steps of 40 s per detection
    for _ in range(45):
        mon.on_step(step_time_s=40.0)
    times = np.concatenate([c.timestamps for c in mon._chunks])
    need = mon.history_s()
    assert need > mon.cfg.lookback_s  # FAST continuity 60 s, but 4 steps of peak and continuity
    assert need <= times.max() - times.min() + 1 <= need + 120


def test_a_fault_in_a_job_with_4_minute_steps_is_declared_only_with_the_longer_history(tmp_path):
    from megatron_rl_lab.monitor.coupled import CoupledConfig, generate_coupled
    from megatron_rl_lab.monitor.replay import replay_online

    st = generate_coupled(
        CoupledConfig(
            machines=8, duration_s=2400, seed=0, fault="cpu_saturation", step_period_s=(240.0, 240.0), step_metrics=True
        )
    )
    grown = replay_online(st.grid, 240.0, OnlineConfig(detect=DetectConfig()), tmp_path / "grown")
    assert [(d.at, d.alert.machine) for d in grown] == [(2400.0, st.labels[0].machine)]  # second detection
    # A fixed 900 s: 4 steps of peak span and 4 of continuity never fit, nothing is declared.
    fixed = replay_online(st.grid, 240.0, OnlineConfig(detect=DetectConfig(), grow_lookback=False), tmp_path / "fixed")
    assert fixed == []
