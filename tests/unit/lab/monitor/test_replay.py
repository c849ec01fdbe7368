"""GridFeed hands a grid to the online monitor in order, leaving NaN samples out."""

import numpy as np
import pytest

from megatron_rl.monitor.config import OnlineConfig
from megatron_rl.monitor.trace import Trace
from megatron_rl.monitor.windows import Grid, to_grid
from megatron_rl_lab.monitor.replay import GridFeed, replay_online


def test_feed_hands_out_every_sample_once_in_order():
    values = np.arange(2 * 3 * 10, dtype=np.float32).reshape(2, 3, 10)
    values[1, 2, 4] = np.nan
    grid = Grid(values, ["gpu_power", "cpu_util"], ["a", "b", "c"], 100.0)
    feed = GridFeed(grid, per_drain=4)
    chunks = [feed.drain() for _ in range(3)]
    assert feed.done and feed.now == 110.0 and [len(c) for c in chunks] == [24, 23, 12]
    rows = [r for c in chunks for r in c]
    assert (104.0, "c", "cpu_util", 0.0) not in rows and len(rows) == 59
    back = to_grid(Trace.from_rows(rows), 1.0)  # the monitor's own resampling gives the grid back
    assert back.machines == grid.machines and back.start == 100.0
    np.testing.assert_array_equal(back.values[[back.metrics.index(m) for m in grid.metrics]], values)


def test_replay_refuses_a_non_positive_step(tmp_path):
    grid = Grid(np.zeros((1, 3, 10), np.float32), ["gpu_power"], ["a", "b", "c"], 0.0)
    with pytest.raises(ValueError, match="step_time_s: 0"):
        replay_online(grid, 0.0, OnlineConfig(), tmp_path)
