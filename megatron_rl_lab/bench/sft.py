"""SFT's update against the RL update phase: the same model, sequences and micro-batch budget.

One process (world 1) builds an actor as training holds it (DDP, distributed Adam), draws
one step's sequences (the packing bench's distributions: prompts and answers), and times
``train_step`` on them twice per round, alternating so both see the same machine noise:
with SFT's token loss (the answers are the assistant tokens) and with DAPO's actor loss
(the answers are the responses, with advantages and old logprobs). Both run through the
same runner on the same packed micro-batches, so the ratio is what the losses themselves
add. Tokens per second count the real tokens of the step.

    megatron-rl bench sft --model cpu-dense-5m --json sft.json
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
    run_checked,
    save_json,
    world_size,
)
from megatron_rl_lab.bench.packing import DISTRIBUTIONS, make_batch, sequence_lengths
from megatron_rl_lab.bench.presets import model_label

EPILOG = """\
examples:
  megatron-rl bench sft --model tiny-dense --steps 5
  megatron-rl bench sft --model cpu-dense-5m --distribution lognormal --median 64 --json sft.json
"""


@dataclasses.dataclass(frozen=True)
class Plan:
    arch: ModelArch
    model_label: str
    distribution: str
    rows: int
    median: int
    steps: int
    seed: int
    json_path: Optional[Path]


def add_parser(sub) -> argparse.ArgumentParser:
    p = bench_parser(
        sub,
        "sft",
        help="SFT's update vs the RL update phase on the same sequences and micro-batches",
        description=__doc__.split("\n\n")[0],
        epilog=EPILOG,
    )
    p.add_argument("--model", default="cpu-dense-5m", help="a preset name or an HF model directory")
    p.add_argument("--distribution", default="default", help="default or lognormal (as bench packing)")
    p.add_argument("--rows", type=positive, default=64, help="sequences per step (a multiple of 8)")
    p.add_argument("--median", type=positive, default=64, help="lognormal: median answer tokens")
    p.add_argument("--steps", type=positive, default=5, help="timed steps of each (after one warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the result here")
    return p


def make_plan(args: argparse.Namespace, world: int) -> Plan:
    if world != 1:
        raise BenchArgumentError(f"bench sft runs in one process; WORLD_SIZE={world}")
    if args.distribution not in DISTRIBUTIONS:
        raise BenchArgumentError(f"--distribution {args.distribution!r}; allowed: {', '.join(DISTRIBUTIONS)}")
    if args.rows % 8:
        raise BenchArgumentError(f"--rows {args.rows} must be a multiple of 8")
    return Plan(
        arch=model_option(args.model),
        model_label=model_label(args.model),
        distribution=args.distribution,
        rows=args.rows,
        median=args.median,
        steps=args.steps,
        seed=args.seed,
        json_path=Path(args.json) if args.json else None,
    )


def measure(plan: Plan, chunks, optimizer) -> dict:
    """Alternating timed steps of the SFT loss and the DAPO actor loss on one batch."""
    from megatron_rl.algorithms import get_recipe
    from megatron_rl.schedules import ActorLoss, Microbatching, train_step
    from megatron_rl.schedules.supervised import TokenNLLLoss

    prompts, answers, seq_length = sequence_lengths(plan.distribution, plan.rows, plan.median, plan.seed)
    batch = make_batch(prompts, answers, seq_length, plan.arch.vocab_size, plan.seed)
    micro = Microbatching(max_tokens=DISTRIBUTIONS[plan.distribution] * seq_length)
    losses = {
        "sft": TokenNLLLoss(plan.arch.vocab_size),
        "rl_update": ActorLoss(get_recipe("dapo"), plan.arch.vocab_size),
    }
    seconds = {name: [] for name in losses}
    for step in range(plan.steps + 1):  # step 0 warms up
        for name, loss in losses.items():
            started = time.perf_counter()
            train_step(chunks, optimizer, batch, loss, micro)
            if step:
                seconds[name].append(time.perf_counter() - started)
    tokens = int(sum(prompts) + sum(answers))
    step_s = {name: statistics.median(s) for name, s in seconds.items()}
    tokens_per_s = {name: tokens / s for name, s in step_s.items()}
    return {
        "distribution": plan.distribution,
        "rows": plan.rows,
        "seq_length": seq_length,
        "tokens": tokens,
        "budget_tokens": micro.max_tokens,
        "step_s": step_s,
        "step_s_all": seconds,
        "tokens_per_s": tokens_per_s,
        "sft_vs_rl_update": tokens_per_s["sft"] / tokens_per_s["rl_update"],
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
        "bench": "sft",
        "model": plan.model_label,
        "dtype": "float32",
        **measure(plan, chunks, optimizer),
        "date": datetime.date.today().isoformat(),
        "host": host.node(),
    }
    print(json.dumps(result, indent=1))
    save_json(result, plan.json_path)
    return result


def run_args(args: argparse.Namespace) -> int:
    """``megatron-rl bench sft``: the exit code."""
    return run_checked("sft", lambda: make_plan(args, world_size()), run)
