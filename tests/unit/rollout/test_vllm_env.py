"""Colocation hygiene: stale vLLM shared-memory segments go, live ones stay."""

import mmap
import os

from megatron_rl.rollout import vllm_env


def test_stale_segments_are_removed_and_mapped_ones_kept(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    stale = shm / f"mrl-test-{os.getpid()}-tp:0-[0-1]-cpushm_0"
    stale.write_bytes(b"\0" * 4096)
    other = shm / "not-vllm-segment"
    other.write_bytes(b"x")
    # A live segment: this process maps a /dev/shm file of that name.
    live_name = f"mrl-test-{os.getpid()}-live-cpushm_1"
    live_path = vllm_env.SHM_DIR / live_name
    live_path.write_bytes(b"\0" * 4096)
    (shm / live_name).write_bytes(b"\0" * 4096)
    try:
        with live_path.open("r+b") as f, mmap.mmap(f.fileno(), 4096):
            removed = vllm_env.remove_stale_shm(shm)
        assert removed == [stale.name]
        assert not stale.exists() and other.exists() and (shm / live_name).exists()
    finally:
        live_path.unlink()


def test_kv_cache_size_is_written_as_vllm_parses_it(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    vllm_env.prepare_environment(None, 1.0, None)
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
