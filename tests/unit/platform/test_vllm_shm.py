"""vLLM's CPU shared memory: stale segments go, live ones stay, a process that skips vLLM's
shutdown unlinks its own."""

import mmap
import os

from megatron_rl.platform import vllm_shm


def test_stale_segments_are_removed_and_mapped_ones_kept(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    stale = shm / f"mrl-test-{os.getpid()}-tp:0-[0-1]-cpushm_0"
    stale.write_bytes(b"\0" * 4096)
    other = shm / "not-vllm-segment"
    other.write_bytes(b"x")
    # A live segment: this process maps a /dev/shm file of that name.
    live_name = f"mrl-test-{os.getpid()}-live-cpushm_1"
    live_path = vllm_shm.SHM_DIR / live_name
    live_path.write_bytes(b"\0" * 4096)
    (shm / live_name).write_bytes(b"\0" * 4096)
    try:
        with live_path.open("r+b") as f, mmap.mmap(f.fileno(), 4096):
            removed = vllm_shm.remove_stale_shm(shm)
        assert removed == [stale.name]
        assert not stale.exists() and other.exists() and (shm / live_name).exists()
    finally:
        live_path.unlink()


def test_a_process_unlinks_the_segments_it_maps_and_no_others():
    """What a training process does in place of vLLM's shutdown (launch.process_exit)."""
    own, unmapped, plain = (
        vllm_shm.SHM_DIR / f"mrl-test-{os.getpid()}-{kind}" for kind in ("own-cpushm_0", "unmapped-cpushm_0", "plain")
    )
    for path in (own, unmapped, plain):
        path.write_bytes(b"\0" * 4096)
    try:
        with own.open("r+b") as f, mmap.mmap(f.fileno(), 4096), plain.open("r+b") as g, mmap.mmap(g.fileno(), 4096):
            assert vllm_shm.unlink_own_shm() == [own.name]
            assert vllm_shm.unlink_own_shm() == []  # now shown "(deleted)": that name is not looked at again
        assert not own.exists() and unmapped.exists() and plain.exists()
    finally:
        for path in (own, unmapped, plain):
            path.unlink(missing_ok=True)
