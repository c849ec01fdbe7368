"""Context-parallel benchmark: one long sequence's actor forward+backward at CP 1, 2 and 4 on
the same ranks, activation memory per rank and step time.

Under torchrun at world W, each CP size runs with DP = W / CP, so every rank always holds
1/CP of one sequence: at CP1 each rank trains a whole sequence of its own, at CP4 four ranks
share one. Two rows per CP size: ``padded`` (one sequence of ``--seq-length`` positions) and
``packed`` (one THD row of ``--pack`` sequences that fill the same positions).

Activation memory is what autograd keeps for the backward: the bytes of every distinct
storage saved by the forward (``torch.autograd.graph.saved_tensors_hooks``), parameters
excluded, measured on the DAPO loss's forward+backward of one micro-batch. Under CP it holds
each rank's share of the per-token activations and logits plus the whole row's keys and
values of every layer (models.cp_attention). Step time is the median wall time of that
forward+backward (no optimizer step), after one warm-up.

    torchrun --nproc-per-node=4 -m megatron_rl bench cp --model cpu-dense-5m --seq-length 8192 --json cp.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform as host
import statistics
import time
from pathlib import Path
from typing import Optional

from megatron_rl.models.hf_config import ModelArch
from megatron_rl_lab.bench.args import (
    BenchArgumentError,
    bench_parser,
    model_option,
    positive,
    positive_list,
    run_checked,
    save_json,
    world_size,
)
from megatron_rl_lab.bench.presets import model_label

EPILOG = """\
examples:
  torchrun --nproc-per-node=4 -m megatron_rl bench cp --model cpu-dense-5m --seq-length 8192
  torchrun --nproc-per-node=2 -m megatron_rl bench cp --model tiny-dense-4l --seq-length 512 --cp 1,2
"""


@dataclasses.dataclass(frozen=True)
class Plan:
    arch: ModelArch
    model_label: str
    seq_length: int
    cp_sizes: tuple[int, ...]
    pack: int
    steps: int
    seed: int
    json_path: Optional[Path]


def add_parser(sub) -> argparse.ArgumentParser:
    p = bench_parser(
        sub,
        "cp",
        help="one long sequence at CP 1, 2, 4 on the same ranks: activation memory per rank, step time (torchrun)",
        description=__doc__.split("\n\n")[0],
        epilog=EPILOG,
    )
    p.add_argument("--model", default="cpu-dense-5m", help="a preset name or an HF model directory")
    p.add_argument("--seq-length", type=positive, default=8192, help="positions of the sequence (and the packed row)")
    p.add_argument("--cp", type=positive_list(int, "1,2,4"), default=[1, 2, 4], help="CP sizes, each dividing WORLD")
    p.add_argument("--pack", type=positive, default=4, help="sequences in the packed row (1: no packed row)")
    p.add_argument("--steps", type=positive, default=2, help="timed forward+backward passes per row (after a warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the result here")
    return p


def make_plan(args: argparse.Namespace, world: int) -> Plan:
    arch = model_option(args.model)
    for cp in args.cp:
        if world % cp:
            raise BenchArgumentError(f"--cp {cp} does not divide WORLD_SIZE={world}; launch with torchrun")
        multiple = 2 * cp * args.pack
        if args.seq_length % multiple:
            raise BenchArgumentError(
                f"--seq-length {args.seq_length} must be a multiple of 2·CP·pack = {multiple} "
                f"(CP={cp}, pack={args.pack}): every sequence splits into 2·CP chunks"
            )
    arch = dataclasses.replace(arch, max_position_embeddings=max(arch.max_position_embeddings, args.seq_length))
    return Plan(
        arch=arch,
        model_label=model_label(args.model),
        seq_length=args.seq_length,
        cp_sizes=tuple(args.cp),
        pack=args.pack,
        steps=args.steps,
        seed=args.seed,
        json_path=Path(args.json) if args.json else None,
    )


class SavedActivations:
    """Bytes of the distinct storages autograd saves for the backward, parameters excluded,
    counted until the backward starts (the first unpack): with one micro-batch that is
    everything the forward leaves for the backward, at its peak. Tensors a backward saves
    again while it recomputes (activation recompute, the CP attention) are transient and
    not counted."""

    def __init__(self, chunks):
        import torch

        self._params = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
        self._seen: dict[int, int] = {}
        self._backward_started = False
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        if not self._backward_started and storage.data_ptr() not in self._params:
            self._seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    def _unpack(self, tensor):
        self._backward_started = True
        return tensor

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def _batch(plan: Plan, sequences: int, per_sequence: int):
    """`sequences` rows of `per_sequence` positions each (random tokens, a 32-token prompt)."""
    from megatron_rl_lab.bench.packing import make_batch

    prompt = min(32, per_sequence // 2)
    return make_batch(
        [prompt] * sequences, [per_sequence - prompt] * sequences, per_sequence, plan.arch.vocab_size, plan.seed
    )


def measure(plan: Plan, cp: int, world: int) -> list[dict]:
    """Both rows at one CP size: activation bytes per rank (max over ranks) and step time."""
    import torch
    import torch.distributed as dist

    from megatron_rl import platform
    from megatron_rl.algorithms import get_recipe
    from megatron_rl.models.builder import BuildOptions
    from megatron_rl.parallel import ParallelConfig, destroy, initialize
    from megatron_rl.schedules import ActorLoss, Microbatching, forward_backward, local_batch
    from megatron_rl_lab.bench.training import build_trainable

    layout = ParallelConfig(context_parallel_size=cp)
    initialize(layout, seed=plan.seed, model=plan.arch.shape())
    chunks, _ = build_trainable("actor", plan.arch, layout, BuildOptions())
    loss = ActorLoss(get_recipe("dapo"), plan.arch.vocab_size)
    dp = world // cp
    rows = {"padded": (_batch(plan, dp, plan.seq_length), Microbatching(micro_batch_size=1))}
    if plan.pack > 1:
        packed = _batch(plan, dp * plan.pack, plan.seq_length // plan.pack)
        rows["packed"] = (packed, Microbatching(max_tokens=plan.seq_length))
    out = []
    for name, (batch, micro) in rows.items():
        local = local_batch(chunks, batch.to(platform.current().device), micro)
        seconds = []
        for step in range(plan.steps + 1):  # step 0 warms up and measures the memory
            with platform.megatron_scope():
                for chunk in chunks:
                    chunk.zero_grad_buffer()
            dist.barrier()
            started = time.perf_counter()
            with SavedActivations(chunks) as saved:
                forward_backward(chunks, local, loss, micro)
            dist.barrier()
            if step:
                seconds.append(time.perf_counter() - started)
            else:
                peak = torch.tensor([saved.bytes], dtype=torch.float64)
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        out.append(
            {
                "cp": cp,
                "row": name,
                "sequences_per_rank": (1 if name == "padded" else plan.pack) / cp,
                "peak_activation_bytes_per_rank": int(peak),
                "step_s": statistics.median(seconds),
            }
        )
    destroy()
    return out


def run(plan: Plan) -> dict:
    import torch.distributed as dist

    from megatron_rl import platform

    platform.init_distributed()
    world = dist.get_world_size()
    results = [r for cp in plan.cp_sizes for r in measure(plan, cp, world)]
    for r in results:
        base = next((b for b in results if b["cp"] == min(plan.cp_sizes) and b["row"] == r["row"]), r)
        r["activation_ratio_to_smallest_cp"] = (
            r["peak_activation_bytes_per_rank"] / base["peak_activation_bytes_per_rank"]
        )
    result = {
        "bench": "cp",
        "model": plan.model_label,
        "seq_length": plan.seq_length,
        "pack": plan.pack,
        "world": world,
        "dtype": "float32",
        "attention": "megatron local, SDPA; CP: all-gather K/V (models.cp_attention)",
        "results": results,
        "date": datetime.date.today().isoformat(),
        "host": host.node(),
    }
    if dist.get_rank() == 0:
        print(json.dumps(result, indent=1))
        save_json(result, plan.json_path)
    return result


def run_args(args: argparse.Namespace) -> int:
    """``megatron-rl bench cp``: the exit code."""
    return run_checked("cp", lambda: make_plan(args, world_size()), run)
