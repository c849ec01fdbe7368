"""Checkpoint benchmark: this store (sync, async) vs Megatron dist_checkpointing (torch_dist)
vs torch.distributed.checkpoint, same model and distributed-optimizer state, one run.

    torchrun --nproc-per-node=4 tools/bench_checkpoint.py --dir /tmp/bench-ckpt

Saves from TP2 (x DP) and loads back into the same layout and into TP1 (DP = world), and
prints per method: training-loop blocking time of a save, total save time (until committed),
load time, load-with-reshard time (max over ranks), and ratios to torch DCP. The async
blocking time (after the first async save, which allocates the host buffers and is reported
apart), the deferred-snapshot save (``snapshot="before_update"``: the call, and the call
plus the wait of an optimizer update issued right after it) and the DCP save are each timed
``--repeats`` times; the medians are reported, with
every sample and the load average in the JSON (the machine may be shared). The DCP
baseline saves each rank's pieces as plain tensors keyed by canonical name and offsets (DCP
writes keys shared by several ranks once); such a state dict has no sharding metadata, so
it cannot reshard (reported as n/a). `--help` lists the options.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl import checkpoint, platform
from megatron_rl.models.hf_config import ModelArch


def _arch(args) -> ModelArch:
    return ModelArch(
        family="qwen3", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_query_groups=args.hidden // 128, head_dim=64,
        ffn_hidden_size=4 * args.hidden, norm_epsilon=1e-6, rope_theta=10000.0,
        max_position_embeddings=128, tie_word_embeddings=False, qkv_bias=False, qk_layernorm=True,
    )


def _build(arch, layout):
    """Model + DDP + distributed optimizer, one training step so Adam state exists."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl.models import build_model
    from megatron_rl.parallel import ParallelConfig, initialize

    parallel = ParallelConfig(**layout)
    initialize(parallel, seed=3, model=arch.shape())
    chunks = build_model("actor", arch, parallel)
    with platform.megatron_scope():
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=True)
        chunks = [DistributedDataParallel(chunks[0].config, ddp, c) for c in chunks]
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, use_distributed_optimizer=True), chunks)
        tokens = torch.randint(0, arch.vocab_size, (1, 17))

        def step(it, model):
            t = next(it)
            out = model(t[:, :-1], torch.arange(16).unsqueeze(0), None, labels=t[:, 1:])
            return out, lambda o: (o.float().mean(), {})

        get_forward_backward_func()(forward_step_func=step, data_iterator=iter([tokens]), model=chunks[0],
                                    num_microbatches=1, seq_length=16, micro_batch_size=1, forward_only=False)
        optimizer.step()
    return chunks, optimizer


def _timed(fn) -> tuple[float, object]:
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    local = time.perf_counter() - start
    times = [None] * dist.get_world_size()
    dist.all_gather_object(times, local)
    return max(times), out


def _timed_deferred(ckpt: checkpoint.Checkpointer, save_call) -> tuple[float, float, object]:
    """(the save call, the call plus an update's wait right after it), max over ranks."""
    dist.barrier()
    start = time.perf_counter()
    handle = save_call()
    call = time.perf_counter() - start
    ckpt.wait_snapshot()  # what an optimizer update issued now would wait
    both = [None] * dist.get_world_size()
    dist.all_gather_object(both, (call, time.perf_counter() - start))
    return max(c for c, _ in both), max(u for _, u in both), handle


def _megatron_state(chunks, optimizer, is_loading):
    meta = {"distrib_optim_sharding_type": "fully_reshardable"}
    with platform.megatron_scope():
        model = {"model0": chunks[0].module.sharded_state_dict()}
        return {**model, "optimizer": optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=meta)}


def _torch_dist_save(chunks, optimizer, path):
    from megatron.core import dist_checkpointing

    with platform.megatron_scope():
        dist_checkpointing.save(_megatron_state(chunks, optimizer, False), str(path))


def _torch_dist_load(chunks, optimizer, path):
    from megatron.core import dist_checkpointing

    with platform.megatron_scope():
        state = dist_checkpointing.load(_megatron_state(chunks, optimizer, True), str(path))
        chunks[0].module.load_state_dict(state["model0"])
        # Not applied: optimizer.load_state_dict(state["optimizer"]) raises KeyError 'step' in
        # 0.16.1 on the torch-Adam path (_set_main_param_and_optimizer_states expects a 'step'
        # tensor the fully_reshardable state omits). Reading it is the cost measured here.


def _dcp_state(chunks, optimizer):
    from megatron_rl.checkpoint.store import _collect

    return {f"{i.name}|{','.join(map(str, i.offsets))}": i.data for i in _collect(chunks, optimizer)}


def _dcp_save(chunks, optimizer, path):
    import torch.distributed.checkpoint as dcp

    dcp.save(_dcp_state(chunks, optimizer), checkpoint_id=str(path))


def _dcp_load(chunks, optimizer, path):
    import torch.distributed.checkpoint as dcp

    dcp.load(_dcp_state(chunks, optimizer), checkpoint_id=str(path))


def run(args) -> dict:
    from megatron_rl.parallel import destroy

    platform.init_distributed()
    if not platform.current().is_cuda:
        # Megatron 0.16.1's filesystem writer (torch_dist baseline) calls torch.cuda.synchronize()
        # unconditionally; on the CPU build there is nothing to wait for. Baseline only.
        torch.cuda.synchronize = lambda *a, **k: None
    world, rank = dist.get_world_size(), dist.get_rank()
    root = Path(args.dir)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        for method in ("ours", "torch_dist", "dcp"):
            (root / method).mkdir(parents=True)
    arch = _arch(args)
    save_layout, load_layout = dict(tensor_model_parallel_size=2), {}
    chunks, optimizer = _build(arch, save_layout)
    nbytes = sum(p.numel() * p.element_size() for p in chunks[0].parameters())
    total = [None] * world
    dist.all_gather_object(total, nbytes)
    r: dict = {"world_size": world, "model_bytes": sum(total) // 2, "save_layout": "TP2", "reshard_layout": "TP1"}
    r["loadavg_start"] = os.getloadavg()
    ckpt = checkpoint.Checkpointer()
    save = lambda step, a, snapshot="at_save": ckpt.save(root / "ours", step, model=chunks, optimizer=optimizer,
                                                         async_save=a, snapshot=snapshot)
    r["ours_sync_save_s"], _ = _timed(lambda: save(1, False))
    r["ours_async_first_blocking_s"], handle = _timed(lambda: save(2, True))
    handle.wait()
    samples = []
    for step in range(3, 3 + args.repeats):  # steady state: items, plan and host buffers reused
        blocking, handle = _timed(lambda: save(step, True))
        handle.wait()
        samples.append(blocking)
    r["ours_async_blocking_samples_s"], r["ours_async_blocking_s"] = samples, statistics.median(samples)
    r["ours_async_save_s"], _ = _timed(lambda: (save(3 + args.repeats, True).wait()))
    # Deferred snapshot: the save call returns before copying; an optimizer update waits for the
    # background copy only if it comes before the copy is done. Both ends are measured: the
    # call alone (RL: a rollout sits between save and update) and call + the wait of an update
    # issued right after it (the worst case).
    calls, immediate = [], []
    for step in range(4 + args.repeats, 4 + 2 * args.repeats):
        call, until_copied, handle = _timed_deferred(ckpt, lambda: save(step, True, "before_update"))
        handle.wait()
        calls.append(call)
        immediate.append(until_copied)
    r["ours_deferred_call_samples_s"], r["ours_deferred_call_s"] = calls, statistics.median(calls)
    r["ours_deferred_immediate_update_samples_s"] = immediate
    r["ours_deferred_immediate_update_s"] = statistics.median(immediate)
    r["torch_dist_save_s"], _ = _timed(lambda: _torch_dist_save(chunks, optimizer, root / "torch_dist"))
    samples = []
    for i in range(args.repeats):
        if rank == 0 and i:  # a fresh directory each time, as for the first sample
            shutil.rmtree(root / "dcp")
            (root / "dcp").mkdir()
        seconds, _ = _timed(lambda: _dcp_save(chunks, optimizer, root / "dcp"))
        samples.append(seconds)
    r["dcp_save_samples_s"], r["dcp_save_s"] = samples, statistics.median(samples)
    r["ours_load_s"], _ = _timed(lambda: ckpt.load(root / "ours", model=chunks, optimizer=optimizer))
    r["torch_dist_load_s"], _ = _timed(lambda: _torch_dist_load(chunks, optimizer, root / "torch_dist"))
    r["dcp_load_s"], _ = _timed(lambda: _dcp_load(chunks, optimizer, root / "dcp"))
    destroy()
    del chunks, optimizer
    chunks, optimizer = _build(arch, load_layout)
    r["ours_reshard_load_s"], _ = _timed(lambda: ckpt.load(root / "ours", model=chunks, optimizer=optimizer))
    ckpt.close()
    r["torch_dist_reshard_load_s"], _ = _timed(lambda: _torch_dist_load(chunks, optimizer, root / "torch_dist"))
    r["dcp_reshard_load_s"] = None
    newest = root / "ours" / f"step_{checkpoint.latest_step(root / 'ours')}"
    r["checkpoint_bytes"] = {m: sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
                             for m, d in (("ours", newest), ("torch_dist", root / "torch_dist"), ("dcp", root / "dcp"))}
    r["loadavg_end"] = os.getloadavg()
    r["ratios"] = {
        "dcp_save_over_ours_async_blocking": r["dcp_save_s"] / r["ours_async_blocking_s"],
        "dcp_save_over_ours_async_blocking_worst": min(r["dcp_save_samples_s"]) / max(r["ours_async_blocking_samples_s"]),
        "dcp_save_over_ours_deferred_call": r["dcp_save_s"] / r["ours_deferred_call_s"],
        "dcp_save_over_ours_deferred_call_worst": min(r["dcp_save_samples_s"]) / max(r["ours_deferred_call_samples_s"]),
        "dcp_save_over_ours_deferred_immediate_update": r["dcp_save_s"] / r["ours_deferred_immediate_update_s"],
        "dcp_save_over_ours_sync_save": r["dcp_save_s"] / r["ours_sync_save_s"],
        "torch_dist_save_over_ours_sync_save": r["torch_dist_save_s"] / r["ours_sync_save_s"],
        "dcp_load_over_ours_load": r["dcp_load_s"] / r["ours_load_s"],
        "torch_dist_load_over_ours_load": r["torch_dist_load_s"] / r["ours_load_s"],
        "torch_dist_reshard_over_ours_reshard": r["torch_dist_reshard_load_s"] / r["ours_reshard_load_s"],
    }
    destroy()
    return r


def _print(r: dict) -> None:
    mb = r["model_bytes"] / 2**20
    print(f"model {mb:.0f} MiB fp32 (+ distributed Adam state), world {r['world_size']}, save TP2, reshard to TP1")
    print(f"{'method':<24}{'blocking s':>11}{'save s':>9}{'load s':>9}{'reshard s':>11}")
    rows = [
        ("ours (sync)", r["ours_sync_save_s"], r["ours_sync_save_s"], r["ours_load_s"], r["ours_reshard_load_s"]),
        ("ours (async)", r["ours_async_blocking_s"], r["ours_async_save_s"], r["ours_load_s"], r["ours_reshard_load_s"]),
        ("ours (async, deferred)", r["ours_deferred_call_s"], None, None, None),
        ("megatron torch_dist", r["torch_dist_save_s"], r["torch_dist_save_s"], r["torch_dist_load_s"], r["torch_dist_reshard_load_s"]),
        ("torch DCP", r["dcp_save_s"], r["dcp_save_s"], r["dcp_load_s"], None),
    ]
    for name, *values in rows:
        print(f"{name:<24}" + "".join(f"{v:>{w}.3f}" if v is not None else f"{'n/a':>{w}}" for v, w in zip(values, (11, 9, 9, 11))))
    for key, value in r["ratios"].items():
        print(f"  {key}: {value:.1f}x")
    show = lambda xs: " ".join(f"{x:.3f}" for x in xs)
    print(f"  async blocking samples s: {show(r['ours_async_blocking_samples_s'])}; DCP save samples s: {show(r['dcp_save_samples_s'])}")
    print(f"  deferred snapshot call samples s: {show(r['ours_deferred_call_samples_s'])}; "
          f"with an update right after it: {show(r['ours_deferred_immediate_update_samples_s'])}")
    print(f"  first async save (allocates host buffers) blocking s: {r['ours_async_first_blocking_s']:.3f}")
    print(f"  load average at start {show(r['loadavg_start'])}, at end {show(r['loadavg_end'])}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/megatron-rl-bench-ckpt", help="scratch directory (wiped)")
    p.add_argument("--hidden", type=int, default=768, help="hidden size (heads = hidden/64)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=5, help="timed steady-state async saves and DCP saves (medians reported)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    result = run(args)
    if dist.get_rank() == 0:
        _print(result)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
