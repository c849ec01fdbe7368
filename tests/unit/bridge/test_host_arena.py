"""The same-host gather arena: mapped by every rank, unlinked at once, opted out by env."""

import pytest
import torch
import torch.distributed as dist

from megatron_rl.bridge import host_arena


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_arena_is_mapped_and_leaves_no_file_behind(one_rank_group):
    before = {p.name for p in host_arena.SHM_DIR.glob("megatron_rl-*")}
    arena = host_arena.open_shared(3 << 20, "unit")
    assert arena.dtype == torch.uint8 and arena.numel() == 3 << 20
    arena[-8:] = 7  # the whole length is writable (pages reserved up front)
    assert int(arena[-1]) == 7
    assert {p.name for p in host_arena.SHM_DIR.glob("megatron_rl-*")} == before


def test_single_rank_is_on_its_own_host(one_rank_group):
    assert host_arena.all_ranks_on_this_host()


def test_transport_setting_names_the_allowed_values(monkeypatch):
    monkeypatch.setenv(host_arena.TRANSPORT_ENV, "broadcast")
    assert host_arena.transport_setting() == "broadcast"
    monkeypatch.setenv(host_arena.TRANSPORT_ENV, "nccl")
    with pytest.raises(ValueError, match="allowed: auto, broadcast"):
        host_arena.transport_setting()
