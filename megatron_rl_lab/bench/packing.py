"""Sequence packing benchmark: the same model and sequences, padded rows vs packed
token-budget micro-batches, in one run.

One process (world 1) builds an actor as training holds it (DDP, distributed Adam) and a
DAPO loss, draws sequence lengths from a distribution, and runs the actor's update on the
same sequences twice per timed round, padded (`micro_batch_size` rows of `seq_length`)
and packed (rows of up to budget = micro_batch_size x seq_length tokens: the same tokens
per micro-batch), alternating so both see the same machine noise. Before timing, one forward/backward of each from the
same weights gives the loss and gradient difference (packing must not change them).

Distributions:
- ``default``: short sequences shaped like the embedded default (`make train`: prompts of
  8-12 tokens, answers of 1-12, seq_length 48, 8 rows per micro-batch; its padded rows
  are ~27 % real tokens).
- ``lognormal``: long-tailed responses, log-normal with median ``--median`` (sigma 1),
  capped at 16x the median, after a 32-token prompt; seq_length = 32 + 16 x median, one
  row per micro-batch (as the cluster recipes pad today).

    megatron-rl bench packing --model cpu-dense-5m --json packing.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
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
    run_checked,
    save_json,
    world_size,
)
from megatron_rl_lab.bench.presets import model_label

DISTRIBUTIONS = {"default": 8, "lognormal": 1}
"""distribution -> padded rows per micro-batch."""
EPILOG = """\
examples:
  megatron-rl bench packing --model tiny-moe-4l --steps 2
  megatron-rl bench packing --model cpu-dense-5m --rows 64 --median 64 --json packing.json
  python tools/bench_packing.py   # the same, with a markdown table
"""


@dataclasses.dataclass(frozen=True)
class Plan:
    arch: ModelArch
    model_label: str
    distributions: tuple[str, ...]
    rows: int
    median: int
    steps: int
    seed: int
    json_path: Optional[Path]


def add_parser(sub) -> argparse.ArgumentParser:
    p = bench_parser(
        sub,
        "packing",
        help="padded vs packed training step on the same sequences",
        description=__doc__.split("\n\n")[0],
        epilog=EPILOG,
    )
    p.add_argument("--model", default="cpu-dense-5m", help="a preset name or an HF model directory")
    p.add_argument("--distributions", default=",".join(DISTRIBUTIONS), help="comma-separated: default, lognormal")
    p.add_argument("--rows", type=positive, default=64, help="sequences per step (a multiple of 8)")
    p.add_argument("--median", type=positive, default=64, help="lognormal: median response tokens")
    p.add_argument("--steps", type=positive, default=3, help="timed steps of each (after one warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the result here")
    return p


def make_plan(args: argparse.Namespace, world: int) -> Plan:
    if world != 1:
        raise BenchArgumentError(f"bench packing runs in one process; WORLD_SIZE={world}")
    chosen = tuple(d for d in args.distributions.split(",") if d)
    unknown = sorted(set(chosen) - set(DISTRIBUTIONS))
    if unknown or not chosen:
        raise BenchArgumentError(f"--distributions {args.distributions!r}; allowed: {', '.join(DISTRIBUTIONS)}")
    if args.rows % 8:
        raise BenchArgumentError(f"--rows {args.rows} must be a multiple of 8 (the default's rows per micro-batch)")
    arch = model_option(args.model)
    return Plan(
        arch=arch,
        model_label=model_label(args.model),
        distributions=chosen,
        rows=args.rows,
        median=args.median,
        steps=args.steps,
        seed=args.seed,
        json_path=Path(args.json) if args.json else None,
    )


def sequence_lengths(distribution: str, rows: int, median: int, seed: int) -> tuple[list[int], list[int], int]:
    """(prompt lengths, response lengths, seq_length) of one step's sequences."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if distribution == "default":
        prompts = torch.randint(8, 13, (rows,), generator=g).tolist()
        responses = torch.randint(1, 13, (rows,), generator=g).tolist()
        return prompts, responses, 48
    cap = 16 * median
    drawn = torch.exp(math.log(median) + torch.randn(rows, generator=g)).round().clamp(1, cap)
    return [32] * rows, [int(x) for x in drawn], 32 + cap


def make_batch(prompts: list[int], responses: list[int], seq_length: int, vocab: int, seed: int):
    """A DAPO mini-batch of random tokens with the given lengths (advantages, old logprobs)."""
    import torch

    from megatron_rl.schedules import TrainBatch, pack_sequences

    g = torch.Generator().manual_seed(seed + 1)
    tokens, mask = pack_sequences(
        [torch.randint(0, vocab, (p,), generator=g).tolist() for p in prompts],
        [torch.randint(0, vocab, (r,), generator=g).tolist() for r in responses],
        seq_length,
    )
    shape = tokens.shape
    return TrainBatch(
        tokens=tokens,
        loss_mask=mask,
        advantages=torch.randn(shape[0], 1, generator=g).expand(shape),
        old_logprobs=-5.0 + 0.1 * torch.randn(shape, generator=g),
        lengths=torch.tensor([p + r for p, r in zip(prompts, responses)]),
    )


def _gradients(chunks, batch, loss, micro) -> tuple[float, dict]:
    """One forward/backward from the current weights: the loss and the full gradients."""
    from megatron_rl import platform
    from megatron_rl.parallel.full_tensors import gather_full, main_grad, params_as
    from megatron_rl.schedules import forward_backward

    with platform.megatron_scope():
        for chunk in chunks:
            chunk.zero_grad_buffer()
    metrics = forward_backward(chunks, batch, loss, micro)
    with params_as(chunks, main_grad):
        return metrics["actor/loss"], gather_full(chunks)


def measure(plan: Plan, chunks, optimizer, distribution: str) -> dict:
    """Padded vs packed on one distribution: equality first, then alternating timed steps."""
    from megatron_rl.algorithms import get_recipe
    from megatron_rl.schedules import ActorLoss, Microbatching, train_step

    prompts, responses, seq_length = sequence_lengths(distribution, plan.rows, plan.median, plan.seed)
    batch = make_batch(prompts, responses, seq_length, plan.arch.vocab_size, plan.seed)
    loss = ActorLoss(get_recipe("dapo"), plan.arch.vocab_size)
    rows_per_micro_batch = DISTRIBUTIONS[distribution]
    modes = {
        "padded": Microbatching(micro_batch_size=rows_per_micro_batch),
        "packed": Microbatching(max_tokens=rows_per_micro_batch * seq_length),
    }
    (padded_loss, padded_grads), (packed_loss, packed_grads) = (
        _gradients(chunks, batch, loss, m) for m in modes.values()
    )
    grad_diff = max(float((packed_grads[k] - g).abs().max()) for k, g in padded_grads.items())
    seconds = {name: [] for name in modes}
    for step in range(plan.steps + 1):  # step 0 warms up
        for name, micro in modes.items():
            started = time.perf_counter()
            train_step(chunks, optimizer, batch, loss, micro)
            if step:
                seconds[name].append(time.perf_counter() - started)
    cost = {name: m.cost(batch, 1) for name, m in modes.items()}
    step_s = {name: statistics.median(s) for name, s in seconds.items()}
    return {
        "distribution": distribution,
        "rows": plan.rows,
        "seq_length": seq_length,
        "real_tokens": cost["packed"]["real_tokens"],
        "budget_tokens": modes["packed"].max_tokens,
        "packing_efficiency": {n: c["real_tokens"] / c["computed_tokens"] for n, c in cost.items()},
        "micro_batches": {n: c["micro_batches"] for n, c in cost.items()},
        "step_s": step_s,
        "step_s_all": seconds,
        "speedup_vs_padded": step_s["padded"] / step_s["packed"],
        "loss_abs_diff": abs(padded_loss - packed_loss),
        "grad_max_abs_diff": grad_diff,
    }


def run(plan: Plan) -> dict:
    from megatron_rl import platform
    from megatron_rl.models.builder import BuildOptions
    from megatron_rl.parallel import ParallelConfig, initialize
    from megatron_rl_lab.bench.training import build_trainable

    platform.init_distributed()
    initialize(ParallelConfig(), seed=plan.seed, model=plan.arch.shape())
    chunks, optimizer = build_trainable("actor", plan.arch, ParallelConfig(), BuildOptions())
    result = {
        "bench": "packing",
        "model": plan.model_label,
        "dtype": "float32",
        "results": [measure(plan, chunks, optimizer, d) for d in plan.distributions],
        "date": datetime.date.today().isoformat(),
        "host": host.node(),
    }
    print(json.dumps(result, indent=1))
    save_json(result, plan.json_path)
    return result


def run_args(args: argparse.Namespace) -> int:
    """``megatron-rl bench packing``: the exit code."""
    return run_checked("packing", lambda: make_plan(args, world_size()), run)
