"""The checkpoint bench's measurements (collective, every rank): see :mod:`.checkpoint`.

Every call into this project's checkpoint store is in :class:`_Store`, so a change of the
store's API touches one small class here.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl import checkpoint, platform
from megatron_rl.models.builder import BuildOptions
from megatron_rl.models.hf_config import ModelArch
from megatron_rl.parallel.config import ParallelConfig
from megatron_rl_lab.bench import hardware
from megatron_rl_lab.bench.checkpoint_scratch import Scratch
from megatron_rl_lab.bench.training import build_trainable, synthetic_microbatches, train_step

METHODS = ("ours", "torch_dist", "dcp")
"""One scratch subdirectory per method."""


class _Store:
    """Every call the bench makes into :mod:`megatron_rl.checkpoint`, for one model and optimizer."""

    def __init__(self, root: Path, chunks, optimizer):
        self.root, self.chunks, self.optimizer = root, chunks, optimizer
        self.checkpointer = checkpoint.Checkpointer()

    def save(self, step: int, async_save: bool, snapshot: str = "at_save"):
        """The store's save; returns its handle (``handle.wait()`` until committed)."""
        return self.checkpointer.save(
            self.root, step, model=self.chunks, optimizer=self.optimizer, async_save=async_save, snapshot=snapshot
        )

    def wait_snapshot(self) -> None:
        """What an optimizer update issued now would wait for (a deferred snapshot's copy)."""
        self.checkpointer.wait_snapshot()

    def load(self) -> None:
        self.checkpointer.load(self.root, model=self.chunks, optimizer=self.optimizer)

    def close(self) -> None:
        """Commit the saves in flight and stop the checkpointer's writer."""
        self.checkpointer.close()

    def newest_step_dir(self) -> Path:
        return self.root / f"step_{checkpoint.latest_step(self.root)}"

    def plain_pieces(self) -> dict:
        """This rank's pieces as plain tensors keyed by canonical name and offsets (the DCP baseline)."""
        from megatron_rl.checkpoint.store import _collect

        return {f"{i.name}|{','.join(map(str, i.offsets))}": i.data for i in _collect(self.chunks, self.optimizer)}


def _timed(fn) -> tuple[float, object]:
    """(seconds of ``fn`` on the slowest rank, its result here); all ranks start together."""
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    return hardware.max_over_ranks([time.perf_counter() - start])[0], out


def _timed_deferred(store: _Store, step: int) -> tuple[float, float, object]:
    """(the deferred save call, the call plus an update's wait right after it), max over ranks."""
    dist.barrier()
    start = time.perf_counter()
    handle = store.save(step, async_save=True, snapshot="before_update")
    call = time.perf_counter() - start
    store.wait_snapshot()
    call, both = hardware.max_over_ranks([call, time.perf_counter() - start])
    return call, both, handle


@contextlib.contextmanager
def _cuda_synchronize_is_a_noop():
    """Megatron-Core 0.16.1's filesystem writer (the torch_dist baseline) calls
    ``torch.cuda.synchronize()`` unconditionally, which raises on the CPU build of torch;
    on CPU there is nothing to wait for. Held only around the baseline's save."""
    if platform.current().is_cuda:
        yield
        return
    original = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        yield
    finally:
        torch.cuda.synchronize = original


def _megatron_state(chunks, optimizer, is_loading: bool) -> dict:
    meta = {"distrib_optim_sharding_type": "fully_reshardable"}
    with platform.megatron_scope():
        model = {"model0": chunks[0].module.sharded_state_dict()}
        return {**model, "optimizer": optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=meta)}


def _torch_dist_save(store: _Store, path: Path) -> None:
    from megatron.core import dist_checkpointing

    with platform.megatron_scope(), _cuda_synchronize_is_a_noop():
        dist_checkpointing.save(_megatron_state(store.chunks, store.optimizer, False), str(path))


def _torch_dist_load(store: _Store, path: Path) -> None:
    from megatron.core import dist_checkpointing

    with platform.megatron_scope():
        state = dist_checkpointing.load(_megatron_state(store.chunks, store.optimizer, True), str(path))
        store.chunks[0].module.load_state_dict(state["model0"])
        # Not applied: optimizer.load_state_dict(state["optimizer"]) raises KeyError 'step' in
        # 0.16.1 on the torch-Adam path (_set_main_param_and_optimizer_states expects a 'step'
        # tensor the fully_reshardable state omits). Reading it is the cost measured here.


def _dcp_save(store: _Store, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(store.plain_pieces(), checkpoint_id=str(path))


def _dcp_load(store: _Store, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(store.plain_pieces(), checkpoint_id=str(path))


def _build(arch: ModelArch, layout: ParallelConfig, root: Path) -> _Store:
    """Model + DDP + distributed optimizer after one training step (so Adam's state exists)."""
    from megatron_rl.parallel import initialize

    initialize(layout, seed=3, model=arch.shape())
    chunks, optimizer = build_trainable("actor", arch, layout, BuildOptions())
    train_step(chunks, optimizer, synthetic_microbatches(1, 1, 16, arch.vocab_size, seed=3), "actor")
    return _Store(root, chunks, optimizer)


def _our_saves(store: _Store, repeats: int) -> dict:
    """Sync save, first async save, steady-state async saves, deferred-snapshot saves."""
    r: dict = {}
    r["ours_sync_save_s"], _ = _timed(lambda: store.save(1, async_save=False))
    r["ours_async_first_blocking_s"], handle = _timed(lambda: store.save(2, async_save=True))
    handle.wait()
    samples = []
    for step in range(3, 3 + repeats):  # steady state: items, plan and host buffers reused
        blocking, handle = _timed(lambda step=step: store.save(step, async_save=True))
        handle.wait()
        samples.append(blocking)
    r["ours_async_blocking_samples_s"], r["ours_async_blocking_s"] = samples, statistics.median(samples)
    r["ours_async_save_s"], _ = _timed(lambda: store.save(3 + repeats, async_save=True).wait())
    # Deferred snapshot: the save call returns before copying; an optimizer update waits for the
    # background copy only if it comes before the copy is done. Both ends are measured: the
    # call alone (RL: a rollout sits between save and update) and call + the wait of an update
    # issued right after it (the worst case).
    calls, immediate = [], []
    for step in range(4 + repeats, 4 + 2 * repeats):
        call, until_copied, handle = _timed_deferred(store, step)
        handle.wait()
        calls.append(call)
        immediate.append(until_copied)
    r["ours_deferred_call_samples_s"], r["ours_deferred_call_s"] = calls, statistics.median(calls)
    r["ours_deferred_immediate_update_samples_s"] = immediate
    r["ours_deferred_immediate_update_s"] = statistics.median(immediate)
    return r


def _baseline_saves(store: _Store, scratch: Scratch, repeats: int) -> dict:
    """Megatron's torch_dist save once; torch DCP's save ``repeats`` times, each into an empty directory."""
    r: dict = {}
    r["torch_dist_save_s"], _ = _timed(lambda: _torch_dist_save(store, scratch.path("torch_dist")))
    samples = []
    for i in range(repeats):
        if i:
            scratch.empty("dcp")  # before _timed's barrier: every sample writes a fresh directory
        seconds, _ = _timed(lambda: _dcp_save(store, scratch.path("dcp")))
        samples.append(seconds)
    r["dcp_save_samples_s"], r["dcp_save_s"] = samples, statistics.median(samples)
    return r


def _loads(store: _Store, scratch: Scratch, resharded: bool, repeats: int) -> dict:
    """Load every method's checkpoint into ``store``'s model ``repeats`` times, the methods taking
    turns in each round (a busy spell of the shared machine falls on all of them); medians and
    every sample. DCP's plain pieces cannot reshard."""
    kind = "reshard_load" if resharded else "load"
    methods = {"ours": store.load, "torch_dist": lambda: _torch_dist_load(store, scratch.path("torch_dist"))}
    if not resharded:
        methods["dcp"] = lambda: _dcp_load(store, scratch.path("dcp"))
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, load in methods.items():
            samples[name].append(_timed(load)[0])
    r: dict = {f"dcp_{kind}_s": None, f"dcp_{kind}_samples_s": None}
    for name, seconds in samples.items():
        r[f"{name}_{kind}_samples_s"], r[f"{name}_{kind}_s"] = seconds, statistics.median(seconds)
    return r


def _model_bytes(store: _Store, layout: ParallelConfig) -> int:
    """Bytes of one model replica: this rank's parameters summed over ranks, over DP."""
    mine = sum(p.numel() * p.element_size() for p in store.chunks[0].parameters())
    total = [None] * dist.get_world_size()
    dist.all_gather_object(total, mine)
    return sum(total) // layout.dp(dist.get_world_size())


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _ratios(r: dict) -> dict:
    return {
        "dcp_save_over_ours_async_blocking": r["dcp_save_s"] / r["ours_async_blocking_s"],
        "dcp_save_over_ours_async_blocking_worst": min(r["dcp_save_samples_s"])
        / max(r["ours_async_blocking_samples_s"]),
        "dcp_save_over_ours_deferred_call": r["dcp_save_s"] / r["ours_deferred_call_s"],
        "dcp_save_over_ours_deferred_call_worst": min(r["dcp_save_samples_s"]) / max(r["ours_deferred_call_samples_s"]),
        "dcp_save_over_ours_deferred_immediate_update": r["dcp_save_s"] / r["ours_deferred_immediate_update_s"],
        "dcp_save_over_ours_sync_save": r["dcp_save_s"] / r["ours_sync_save_s"],
        "torch_dist_save_over_ours_sync_save": r["torch_dist_save_s"] / r["ours_sync_save_s"],
        "dcp_load_over_ours_load": r["dcp_load_s"] / r["ours_load_s"],
        "torch_dist_load_over_ours_load": r["torch_dist_load_s"] / r["ours_load_s"],
        "torch_dist_reshard_over_ours_reshard": (
            r["torch_dist_reshard_load_s"] / r["ours_reshard_load_s"] if r["ours_reshard_load_s"] else None
        ),
    }


def _device_name() -> str:
    return torch.cuda.get_device_name() if platform.current().is_cuda else "cpu"


def measure(
    arch: ModelArch,
    save_layout: ParallelConfig,
    reshard_layout: Optional[ParallelConfig],
    scratch: Scratch,
    repeats: int,
) -> dict:
    """Save in ``save_layout``, load back into it and into ``reshard_layout`` (None: no
    reshard, as on one device); the results."""
    from megatron_rl.parallel import destroy

    store = _build(arch, save_layout, scratch.path("ours"))
    r = {
        "world_size": dist.get_world_size(),
        "model_bytes": _model_bytes(store, save_layout),
        "device": _device_name(),
        "save_layout": f"TP{save_layout.tp}",
        "reshard_layout": f"TP{reshard_layout.tp}" if reshard_layout else None,
        "loadavg_start": os.getloadavg(),
    }
    r.update(_our_saves(store, repeats))
    r.update(_baseline_saves(store, scratch, repeats))
    r.update(_loads(store, scratch, resharded=False, repeats=repeats))
    if reshard_layout is None:
        r.update(ours_reshard_load_s=None, torch_dist_reshard_load_s=None, dcp_reshard_load_s=None)
    else:
        store.close()
        destroy()
        del store
        store = _build(arch, reshard_layout, scratch.path("ours"))
        r.update(_loads(store, scratch, resharded=True, repeats=repeats))
    r["checkpoint_bytes"] = {
        "ours": _dir_bytes(store.newest_step_dir()),
        "torch_dist": _dir_bytes(scratch.path("torch_dist")),
        "dcp": _dir_bytes(scratch.path("dcp")),
    }
    r["loadavg_end"] = os.getloadavg()
    r["ratios"] = _ratios(r)
    store.close()
    destroy()
    return r
