"""The continuity rule's defaults (110 s of candidacy, gaps of up to 16 s) on hand-built
grids: a sustained fault is declared soon after 110 s, two separate slowdowns of a
healthy machine are not joined into one run, and a GPU that is idle half of every minute
is still declared because the peer scores, not the gap tolerance, carry its off-periods;
and the recurrence rule: a machine that is the candidate in half of its windows over eight
minutes is declared without any run, on per-window scores built by hand."""

import numpy as np
import pytest

from megatron_rl.monitor.detect import DetectConfig, Scores, declare, detect
from megatron_rl.monitor.period import time_scales

DEFAULT = DetectConfig()
BEFORE = DetectConfig(continuity_s=120.0, max_gap_s=24.0)  # the rule until 2026-11-26


def test_defaults_are_fourteen_windows_with_two_missed_windows_tolerated():
    assert DEFAULT.continuity_s == 110.0 and DEFAULT.max_gap_s == 16.0
    assert DEFAULT.max_gap_s == 2 * DEFAULT.stride_s


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_sustained_fault_is_declared_within_continuity_and_one_window(make_grid, seed):
    grid = make_grid(seed=seed, faults=[(3, "cpu_util", 200, 600, 8.0)])
    alerts = detect(grid, DEFAULT).alerts
    assert [(a.machine, a.metric) for a in alerts] == [("node03", "cpu_util")]
    a = alerts[0]
    assert a.declared_at - a.first_seen >= DEFAULT.continuity_s
    assert a.declared_at <= 200 + DEFAULT.continuity_s + DEFAULT.window_s  # one window of alignment
    assert a.declared_at < detect(grid, BEFORE).alerts[0].declared_at


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_separate_slowdowns_of_a_healthy_machine_are_not_one_run(make_grid, seed):
    # Two 40 s slowdowns, 50 s apart. The 32 s level keeps the machine a candidate for
    # most of the hole; three missed windows were tolerated before, two are now.
    grid = make_grid(seed=seed, faults=[(3, "cpu_util", 200, 240, 8.0), (3, "cpu_util", 290, 330, 8.0)])
    assert detect(grid, DEFAULT).alerts == []
    assert [a.machine for a in detect(grid, BEFORE).alerts] == ["node03"]  # joined across the hole


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_gpu_idle_half_of_every_minute_is_declared_by_the_peer_scores(make_grid, seed):
    # 30 s off in every minute: no run of the window-shape score lasts 110 s with holes of
    # at most 16 s, but the level and intermittency scores stay high across the holes.
    flaps = [(5, "gpu_duty_cycle", s, s + 30, -8.0) for s in range(200, 900, 60)]
    grid = make_grid(duration=900, seed=seed, faults=flaps)
    alerts = detect(grid, DEFAULT).alerts
    assert [a.machine for a in alerts] == ["node05"]
    assert alerts[0].declared_at <= 200 + DEFAULT.continuity_s + DEFAULT.window_s
    # Without the peer scores and the recurrence rule nothing is declared; the recurrence
    # rule alone finds it, eight minutes into the fault at the latest.
    assert detect(grid, DetectConfig(peer_scores=False, recurrence_s=0)).alerts == []
    late = detect(grid, DetectConfig(peer_scores=False)).alerts
    assert [a.machine for a in late] == ["node05"] and late[0].declared_at <= 200 + DEFAULT.recurrence_s


def _scores(hit_windows, n_windows=100, scales=None):
    """Eight machines, one metric, 8 s windows; machine m0 scores 10 (above the 6.5
    threshold) in `hit_windows` and 0 elsewhere, like everyone else."""
    z = np.zeros((1, 8, n_windows))
    z[0, 0, hit_windows] = 10.0
    start = np.arange(n_windows) * 8.0
    return Scores(z, ["gpu_duty_cycle"], [f"m{i}" for i in range(8)], start, start + 7.0, scales)


def test_recurrence_declares_a_machine_that_is_the_candidate_every_other_window():
    # Half the windows: no run ever holds 75 % of its windows, but the 60 windows (480 s)
    # ending at window 59 hold 30 candidates = 0.5 of them.
    scores = _scores(np.arange(0, 100, 2))
    assert DEFAULT.recurrence_s == 480.0 and DEFAULT.recurrence_fraction == 0.5
    alerts = declare(scores, DEFAULT).alerts
    assert [(a.machine, a.metric, a.first_seen, a.declared_at, a.score) for a in alerts] == \
        [("m0", "gpu_duty_cycle", 0.0, 59 * 8 + 7.0, 10.0)]
    assert declare(scores, DetectConfig(recurrence_s=0)).alerts == []


def test_recurrence_needs_more_than_two_minute_and_a_half_episodes_in_eight_minutes():
    # Episodes of 12 windows (95 s, shorter than the 110 s continuity), 10 windows apart:
    # two of them are 24 of 60 windows, three are 36.
    two = np.r_[0:12, 22:34]
    assert declare(_scores(two), DEFAULT).alerts == []
    three = np.r_[two, 44:56]
    assert [a.declared_at for a in declare(_scores(three), DEFAULT).alerts] == [59 * 8 + 7.0]


def test_recurrence_is_off_for_step_averaged_metrics():
    scales = time_scales(DEFAULT, 60.0, 60.0)  # 60 s steps: metrics averaged over a step
    assert scales.average_s == 60.0
    assert declare(_scores(np.arange(0, 100, 2), scales=scales), DEFAULT).alerts == []
