"""The continuity rule's defaults (110 s of candidacy, gaps of up to 16 s) on hand-built
grids: a sustained fault is declared soon after 110 s, two separate slowdowns of a
healthy machine are not joined into one run, and a GPU that is idle half of every minute
is still declared because the peer scores, not the gap tolerance, carry its off-periods;
the recurrence rule: a machine that is the candidate in half of its windows over eight
minutes is declared without any run; and the crowd guard: a metric-window where many
machines are above the threshold makes no candidate, and runs bridge it without counting
it; a job above 128 machines needs 30 s more continuity per doubling; and two bursts
of candidacy with a recovered gap between them are one run only once a third comes. The
last five on per-window scores built by hand."""

from dataclasses import replace

import numpy as np
import pytest

from megatron_rl.monitor.detect import DetectConfig, Scores, crowds, declare, detect
from megatron_rl.monitor.period import size_continuity_s, time_scales
from megatron_rl.monitor.tuning import TUNING, Tuning

DEFAULT = DetectConfig()
BEFORE = DetectConfig(continuity_s=120.0)  # with LOOSE: a looser continuity rule
LOOSE = Tuning(max_gap_s=24.0, join_bursts=2)


def test_defaults_are_fourteen_windows_with_two_missed_windows_tolerated():
    assert DEFAULT.continuity_s == 110.0 and TUNING.max_gap_s == 16.0
    assert TUNING.max_gap_s == 2 * DEFAULT.stride_s


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_sustained_fault_is_declared_within_continuity_and_one_window(make_grid, seed):
    grid = make_grid(seed=seed, faults=[(3, "cpu_util", 200, 600, 8.0)])
    alerts = detect(grid, DEFAULT).alerts
    assert [(a.machine, a.metric) for a in alerts] == [("node03", "cpu_util")]
    a = alerts[0]
    assert a.declared_at - a.first_seen >= DEFAULT.continuity_s
    assert a.declared_at <= 200 + DEFAULT.continuity_s + DEFAULT.window_s  # one window of alignment
    assert a.declared_at < detect(grid, BEFORE, tuning=LOOSE).alerts[0].declared_at


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_two_separate_slowdowns_of_a_healthy_machine_are_not_one_run(make_grid, seed):
    # Two 40 s slowdowns, 50 s apart. The 32 s level keeps the machine a candidate for
    # most of the hole; three missed windows were tolerated before, two are now.
    grid = make_grid(seed=seed, faults=[(3, "cpu_util", 200, 240, 8.0), (3, "cpu_util", 290, 330, 8.0)])
    assert detect(grid, DEFAULT).alerts == []
    assert [a.machine for a in detect(grid, BEFORE, tuning=LOOSE).alerts] == ["node03"]  # joined across the hole


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_gpu_idle_half_of_every_minute_is_declared_by_the_peer_scores(make_grid, seed):
    # 30 s off in every minute: no run of the window-shape score lasts 110 s with holes of
    # at most 16 s, but the level and intermittency scores stay high across the holes.
    flaps = [(5, "gpu_duty_cycle", s, s + 30, -8.0) for s in range(200, 900, 60)]
    grid = make_grid(duration=900, seed=seed, faults=flaps)
    alerts = detect(grid, DEFAULT).alerts
    assert [a.machine for a in alerts] == ["node05"]
    # Where the peer scores leave one gap in the run (a window after the first off-period
    # scores about 0), its two bursts are not joined until a third (join_bursts): the
    # second, from the second off-period at 260 s, must hold continuity alone.
    assert alerts[0].declared_at <= 260 + DEFAULT.continuity_s + DEFAULT.window_s
    # Joining every gap, continuity reached while the GPU is on is in the echo of its window
    # score (echo_s): declared when the score fires again, at the next off-period, 30 s later at most.
    joined = replace(TUNING, join_bursts=2)
    assert (
        detect(grid, DEFAULT, tuning=joined).alerts[0].declared_at <= 200 + DEFAULT.continuity_s + 30 + DEFAULT.window_s
    )
    assert (
        detect(grid, DEFAULT, tuning=replace(joined, echo_s=0.0)).alerts[0].declared_at
        <= 200 + DEFAULT.continuity_s + DEFAULT.window_s
    )
    # Without the peer scores and the recurrence rule nothing is declared; the recurrence
    # rule alone finds it, eight minutes into the fault at the latest.
    assert detect(grid, DEFAULT, tuning=Tuning(peer_scores=False, recurrence_s=0)).alerts == []
    late = detect(grid, DEFAULT, tuning=Tuning(peer_scores=False)).alerts
    assert [a.machine for a in late] == ["node05"] and late[0].declared_at <= 200 + TUNING.recurrence_s


def _scores(hit_windows, n_windows=100, scales=None, machines=8):
    """Eight machines, one metric, 8 s windows; machine m0 scores 10 (above the 6.5
    threshold) in `hit_windows` and 0 elsewhere, like everyone else."""
    z = np.zeros((1, machines, n_windows))
    z[0, 0, hit_windows] = 10.0
    start = np.arange(n_windows) * 8.0
    return Scores(z, ["gpu_duty_cycle"], [f"m{i}" for i in range(machines)], start, start + 7.0, scales)


def test_continuity_grows_by_thirty_seconds_per_doubling_above_128_machines():
    assert [size_continuity_s(TUNING, n) for n in (None, 8, 128, 256, 512, 1024)] == [0, 0, 0, 30, 60, 90]
    assert time_scales(DEFAULT, TUNING, None, machines=1024).continuity_s == 200.0
    assert time_scales(DEFAULT, TUNING, 60.0, machines=1024).continuity_s == 4 * 60.0  # four steps are longer
    # m0 the candidate from window 0 (start 0 s) on: declared at the first window ending at
    # least the job's continuity after 0 s: 110 s -> window 13 (111 s), 140 s -> 17 (143 s),
    # 200 s -> 25 (207 s).
    long_run = np.arange(0, 30)
    for machines, window in ((8, 13), (128, 13), (256, 17), (1024, 25)):
        alerts = declare(_scores(long_run, n_windows=40, machines=machines), DEFAULT).alerts
        assert [(a.machine, a.declared_at) for a in alerts] == [("m0", window * 8 + 7.0)], machines
    # 20 windows (159 s) of candidacy: a fault in a job of 128 machines, not in one of 1024.
    short_run = np.arange(0, 20)
    assert [a.machine for a in declare(_scores(short_run, n_windows=40, machines=128), DEFAULT).alerts] == ["m0"]
    assert declare(_scores(short_run, n_windows=40, machines=1024), DEFAULT).alerts == []
    assert [
        a.machine
        for a in declare(
            _scores(short_run, n_windows=40, machines=1024), DEFAULT, tuning=Tuning(continuity_per_doubling_s=0.0)
        ).alerts
    ] == ["m0"]
    for bad in ({"continuity_per_doubling_s": -1.0}, {"continuity_machines": 0}):
        with pytest.raises(ValueError, match="continuity_per_doubling_s must be >= 0 and continuity_machines >= 1"):
            Tuning(**bad)


def test_two_bursts_are_one_run_only_once_a_third_comes():
    # m0 the candidate in windows 0-7 and 10-17: a gap of two windows (16 s, within
    # max_gap_s) in which it scores 0, so it recovered. Joined, the run reaches 110 s at
    # window 13 (111 s); as two bursts the second (from 80 s) would need to last to 190 s.
    two = np.r_[0:8, 10:18]
    assert TUNING.join_bursts == 3 and TUNING.gap_depth == 0.75
    assert declare(_scores(two), DEFAULT).alerts == []
    joined = declare(_scores(two), DEFAULT, tuning=Tuning(join_bursts=2)).alerts
    assert [(a.machine, a.first_seen, a.declared_at) for a in joined] == [("m0", 0.0, 13 * 8 + 7.0)]
    # A third burst from window 20 joins all three: 167 s of run, 17 candidate windows of 21.
    three = declare(_scores(np.r_[two, 20:40]), DEFAULT).alerts
    assert [(a.first_seen, a.declared_at) for a in three] == [(0.0, 20 * 8 + 7.0)]
    # A second burst that holds continuity alone is declared: 80 s + 110 s -> window 23 (191 s).
    long_second = declare(_scores(np.r_[0:8, 10:40]), DEFAULT).alerts
    assert [(a.first_seen, a.declared_at) for a in long_second] == [(0.0, 23 * 8 + 7.0)]


def test_a_dip_just_under_the_threshold_is_not_a_gap_between_bursts():
    # The same two stretches, but in the two windows between them m0 scores 6.0: under the
    # 6.5 threshold, over 0.75 x 6.5 = 4.875. It never recovered: one burst, declared at 111 s.
    scores = _scores(np.r_[0:8, 10:18])
    scores.z[0, 0, 8:10] = 6.0
    assert [a.declared_at for a in declare(scores, DEFAULT).alerts] == [13 * 8 + 7.0]
    assert declare(scores, DEFAULT, tuning=Tuning(gap_depth=1.0)).alerts == []  # any gap splits
    for bad in ({"join_bursts": 1}, {"gap_depth": 0.0}, {"gap_depth": 1.5}):
        with pytest.raises(ValueError, match="join_bursts must be >= 2|gap_depth must be in"):
            Tuning(**bad)


def test_recurrence_declares_a_machine_that_is_the_candidate_every_other_window():
    # Half the windows: no run ever holds 75 % of its windows, but the 60 windows (480 s)
    # ending at window 59 hold 30 candidates = 0.5 of them.
    scores = _scores(np.arange(0, 100, 2))
    assert TUNING.recurrence_s == 480.0 and TUNING.recurrence_fraction == 0.5
    alerts = declare(scores, DEFAULT).alerts
    assert [(a.machine, a.metric, a.first_seen, a.declared_at, a.score) for a in alerts] == [
        ("m0", "gpu_duty_cycle", 0.0, 59 * 8 + 7.0, 10.0)
    ]
    assert declare(scores, DEFAULT, tuning=Tuning(recurrence_s=0)).alerts == []


def test_recurrence_needs_more_than_two_minute_and_a_half_episodes_in_eight_minutes():
    # Episodes of 12 windows (95 s, shorter than the 110 s continuity), 10 windows apart:
    # two of them are 24 of 60 windows, three are 36.
    two = np.r_[0:12, 22:34]
    assert declare(_scores(two), DEFAULT).alerts == []
    three = np.r_[two, 44:56]
    assert [a.declared_at for a in declare(_scores(three), DEFAULT).alerts] == [59 * 8 + 7.0]


def test_recurrence_is_off_for_step_averaged_metrics():
    scales = time_scales(DEFAULT, TUNING, 60.0, 60.0)  # 60 s steps: metrics averaged over a step
    assert scales.average_s == 60.0
    assert declare(_scores(np.arange(0, 100, 2), scales=scales), DEFAULT).alerts == []


def test_a_crowd_is_two_machines_and_more_than_a_tenth():
    assert TUNING.crowd_machines == 2 and TUNING.crowd_fraction == 0.1
    z = np.zeros((1, 8, 3))
    z[0, :2, 0] = 10.0  # two of eight above the threshold: at least 2 and more than 0.8
    z[0, :1, 1] = 10.0  # one: an outlier
    z[0, :2, 2] = 6.5  # at the threshold is not above it
    assert crowds(z, 6.5, 0.1, 2).tolist() == [[True, False, False]]
    assert crowds(z, 6.5, 0.1, 3).tolist() == [[False, False, False]]  # with three machines to a crowd
    mid = np.zeros((1, 20, 1))
    mid[0, :2, 0] = 10.0  # 2 of 20 is not more than 2.0; 3 is
    assert not crowds(mid, 6.5, 0.1, 2)[0, 0]
    mid[0, 2, 0] = 10.0
    assert crowds(mid, 6.5, 0.1, 2)[0, 0]
    big = np.zeros((1, 64, 1))
    big[0, :6, 0] = 10.0  # 6 of 64 is not more than 6.4; 7 is
    assert not crowds(big, 6.5, 0.1, 2)[0, 0]
    big[0, 6, 0] = 10.0
    assert crowds(big, 6.5, 0.1, 2)[0, 0]
    with pytest.raises(ValueError, match="crowd_machines must be >= 2"):
        Tuning(crowd_machines=1)


def test_a_pair_that_differs_together_in_a_small_job_is_not_declared():
    # Two of eight machines above the threshold together for 40 windows (a rack or a
    # stage that differs from the others): a crowd in every window, so neither is ever a
    # candidate. Counted as outliers (crowd_machines 3), both are declared at 111 s.
    scores = _scores(np.arange(0, 40))
    scores.z[0, 1, :40] = 10.0
    assert declare(scores, DEFAULT).alerts == []
    before = declare(scores, DEFAULT, tuning=Tuning(crowd_machines=3)).alerts
    assert [(a.machine, a.declared_at) for a in before] == [("m0", 13 * 8 + 7.0), ("m1", 13 * 8 + 7.0)]


def test_a_crowd_makes_no_candidate_and_a_run_bridges_it_without_counting_it():
    # m0 alone above the threshold in windows 0-9 and 15-40; in windows 10-14 m1 and m2
    # are above too: a crowd of three (of two, too).
    scores = _scores(np.r_[0:41])
    scores.z[0, 1:3, 10:15] = 10.0
    alerts = declare(scores, DEFAULT).alerts
    # The run counts 0-9 and 15-: 110 s of it end at window 18 (18 * 8 + 7 - 5 * 8 = 111 s).
    assert [(a.machine, a.first_seen, a.declared_at) for a in alerts] == [("m0", 0.0, 18 * 8 + 7.0)]
    # Without the guard m0 is declared at 111 s, and m1, m2 (five windows) are not.
    off = declare(scores, DEFAULT, tuning=Tuning(crowd_fraction=1.0)).alerts
    assert [(a.machine, a.declared_at) for a in off] == [("m0", 13 * 8 + 7.0)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_level_echo_of_a_slowdown_does_not_complete_continuity(make_grid, seed):
    # 90-100 s of a high window score, then the 32 s level echoes it: 110 s of candidacy,
    # declared without the echo rule. 110 s of the window score itself is declared by both,
    # at the same time.
    for length in (90, 100):
        grid = make_grid(seed=seed, faults=[(3, "cpu_util", 200, 200 + length, 8.0)])
        assert detect(grid, DEFAULT).alerts == []
        assert [a.machine for a in detect(grid, DEFAULT, tuning=Tuning(echo_s=0.0)).alerts] == ["node03"]
    grid = make_grid(seed=seed, faults=[(3, "cpu_util", 200, 310, 8.0)])
    on, off = detect(grid, DEFAULT).alerts, detect(grid, DEFAULT, tuning=Tuning(echo_s=0.0)).alerts
    assert [a.machine for a in on] == ["node03"] and on[0].declared_at == off[0].declared_at
