import numpy as np
import pytest

from megatron_rl.monitor.windows import Grid
from megatron_rl.tasks import get_task
from megatron_rl.tasks.chat_format import training_text
from megatron_rl.tasks.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    """Megatron's model-parallel state at world 1 (gloo), with the CPU layer."""
    import torch.distributed as dist

    from megatron_rl import platform
    from megatron_rl.parallel import ParallelConfig, destroy, initialize

    platform.current()
    store = tmp_path_factory.mktemp("world1") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    initialize(ParallelConfig(), seed=1234)
    yield
    destroy()
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def tokenizer():
    """A real HF fast tokenizer with a chat template (the tiny base's, trained in ~0.1 s)."""
    examples = get_task("digits_max").generate(200, seed=0)
    return train_tokenizer(["".join(training_text(e)) for e in examples])


# Hand-built grids with known faults for the monitor's tests (runtime and lab), independent of
# the lab's trace generators.
GRID_METRICS = ["cpu_util", "gpu_duty_cycle", "gpu_power"]  # already in priority order


def build_grid(
    machines: int = 16,
    duration: int = 600,
    seed: int = 0,
    faults: tuple = (),
    metrics: list[str] = GRID_METRICS,
    noise: float = 1.0,
) -> Grid:
    """Common signal + per-machine Gaussian noise; each fault is
    (machine, metric, start_s, end_s, offset) added to that machine's metric."""
    rng = np.random.default_rng(seed)
    t = np.arange(duration)
    # Machines move together, slowly: a cycle longer than a third of any grid here, so
    # the detector's step-period estimate (period.py) sees no training step in it and
    # keeps its default time scales. (With a 97 s cycle it would take 97 s steps.)
    common = 50 + 10 * np.sin(2 * np.pi * t / 1000)
    values = np.empty((len(metrics), machines, duration), np.float32)
    for k in range(len(metrics)):
        values[k] = common[None] * (k + 1) + rng.normal(0, noise, (machines, duration))
    for machine, metric, start, end, offset in faults:
        values[metrics.index(metric), machine, start:end] += offset
    return Grid(values, list(metrics), [f"node{i:02d}" for i in range(machines)], start=0.0)


@pytest.fixture
def make_grid():
    return build_grid
