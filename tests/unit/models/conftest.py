"""Fixtures of the model tests."""

import pytest
import torch.distributed as dist

from megatron_rl import platform
from megatron_rl.parallel import ParallelConfig, destroy, initialize


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    """Megatron's model-parallel state at world 1 (gloo), with the CPU layer."""
    platform.current()
    store = tmp_path_factory.mktemp("world1") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    initialize(ParallelConfig(), seed=1234)
    yield
    destroy()
    dist.destroy_process_group()
