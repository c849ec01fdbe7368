"""The continuity rule's defaults (110 s of candidacy, gaps of up to 16 s) on hand-built
grids: a sustained fault is declared soon after 110 s, two separate slowdowns of a
healthy machine are not joined into one run, and a GPU that is idle half of every minute
is still declared because the peer scores, not the gap tolerance, carry its off-periods."""

import pytest

from megatron_rl.monitor.detect import DetectConfig, detect

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
    assert detect(grid, DetectConfig(peer_scores=False)).alerts == []
