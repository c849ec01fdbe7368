"""`megatron-rl bench step`: a recipe's RL steps with each phase priced against its floor.

The bench runs the recipe's own trainer (world 1, colocated) for ``--steps`` steps with a
clock on its phases (:mod:`.step_phases`), then, in the same process on the last step's own
requests and batch, measures what each phase would cost with nothing around it
(:mod:`.step_floors`): generation against vLLM's own generate; the no-grad passes and the
update against a bare forward (and backward) of the same micro-batches through the same
Megatron model, and through transformers' model of the same architecture; the weight sync
against one copy of its bytes. Phase seconds are means over steps 2..N (step 1 pays the
engines' and optimizer's first-call costs). A row per (phase, floor):

    phase, seconds, floor, floor_seconds, ratio      (ratio = seconds / floor_seconds)

and an ``overhead`` row: the step's seconds that no phase accounts for (batch assembly,
metrics, logging), its ratio the share of the step. Phases without a floor (scoring and
shaping, advantages, checkpoint) have floor null.

    megatron-rl bench step --config examples/grpo.yaml --json step.json
    megatron-rl bench step --config examples/grpo.yaml --model tiny-dense --steps 4
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform as host
import tempfile
from pathlib import Path
from typing import Optional

from megatron_rl_lab.bench.args import BenchArgumentError, bench_parser, positive, run_checked, save_json, world_size

EPILOG = """\
examples:
  megatron-rl bench step --config examples/grpo.yaml --json step.json
  megatron-rl bench step --config examples/dapo.yaml --model tiny-dense --steps 4 --repeats 5
"""
NO_GRAD_PHASES = ("old_logprobs", "reference_logprobs")
"""Phases that are one forward of the actor's micro-batches through the actor's architecture
(the reference is the actor's base); a teacher is another model, with no floor here."""
ORDER = (
    "generation",
    "scoring_and_shaping",
    "critic_values",
    "old_logprobs",
    "rollout_correction",
    "reference_logprobs",
    "teacher_logprobs",
    "advantages",
    "distill",
    "save_rollouts",
    "update",
    "weight_sync",
    "checkpoint",
    "eval",
)
"""Rows in the order RLTrainer.step runs the phases."""
IDLE_S = 5e-4
"""A phase under this took no work (its method returned at once: no critic, no reference):
left out of the rows, still inside the step's accounting."""


@dataclasses.dataclass(frozen=True)
class Plan:
    config: Path
    overrides: tuple[str, ...]
    steps: int
    repeats: int
    json_path: Optional[Path]


def add_parser(sub) -> argparse.ArgumentParser:
    p = bench_parser(
        sub,
        "step",
        help="a recipe's RL step, each phase against its floor measured on the same data",
        description=__doc__.split("\n\n")[0],
        epilog=EPILOG,
    )
    p.add_argument("--config", required=True, help="the recipe's YAML (e.g. examples/grpo.yaml)")
    p.add_argument("--model", default=None, help="model.preset to run it with (default: the recipe's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    p.add_argument("--steps", type=positive, default=3, help="RL steps to run (the means leave out step 1)")
    p.add_argument("--repeats", type=positive, default=3, help="timed runs of each floor (the median is kept)")
    p.add_argument("--json", default=None, help="write the result here")
    return p


def make_plan(args: argparse.Namespace, world: int) -> Plan:
    """The plan, with the config loaded once here so bad input fails before anything is built."""
    from megatron_rl.config import ConfigError, load_config

    if world != 1:
        raise BenchArgumentError(f"bench step runs one process (world 1, colocated); WORLD_SIZE={world}")
    if args.steps < 2:
        raise BenchArgumentError(f"--steps {args.steps}: at least 2 (step 1 is left out of the means)")
    overrides = (*args.set, *([f"model.preset={args.model}"] if args.model else []))
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as err:
        raise BenchArgumentError(str(err)) from None
    if cfg.rollout.placement != "colocated":
        raise BenchArgumentError(f"rollout.placement={cfg.rollout.placement!r}: bench step runs colocated only")
    if cfg.algorithm.trains_reward_model or cfg.algorithm.recipe == "sft":
        raise BenchArgumentError(f"algorithm.recipe={cfg.algorithm.recipe!r} has no RL step (bench sft times SFT)")
    return Plan(
        config=Path(args.config),
        overrides=tuple(overrides),
        steps=args.steps,
        repeats=args.repeats,
        json_path=Path(args.json) if args.json else None,
    )


def mean_phases(records) -> tuple[dict[str, float], float]:
    """Mean seconds per phase and per step over the records after the first."""
    timed = records[1:]
    names = sorted({name for r in timed for name in r.phases})
    phases = {n: sum(r.phases.get(n, 0.0) for r in timed) / len(timed) for n in names}
    return phases, sum(r.step_s for r in timed) / len(timed)


def phase_rows(phases: dict[str, float], step_s: float, floors: dict[str, dict[str, float]]) -> list[dict]:
    """The bench's rows from mean phase seconds, the step's seconds and each phase's floors
    ({phase: {floor name: seconds}}). ``rollout`` is split into generation and the rest of
    the rollout (scoring, shaping); the overhead is the step minus every top-level phase."""
    top = {k: v for k, v in phases.items() if k != "generation"}
    if "rollout" in top and "generation" in phases:
        top["scoring_and_shaping"] = top.pop("rollout") - phases["generation"]
        top["generation"] = phases["generation"]
    rows = []
    for phase in sorted(top, key=lambda p: ORDER.index(p) if p in ORDER else len(ORDER)):
        seconds = top[phase]
        if seconds < IDLE_S:
            continue
        for floor, floor_seconds in (floors.get(phase) or {None: None}).items():
            ratio = seconds / floor_seconds if floor_seconds else None
            rows.append(dict(phase=phase, seconds=seconds, floor=floor, floor_seconds=floor_seconds, ratio=ratio))
    overhead = step_s - sum(top.values())
    rows.append(dict(phase="overhead", seconds=overhead, floor="step", floor_seconds=step_s, ratio=overhead / step_s))
    return rows


def measure_floors(trainer, record, repeats: int) -> tuple[dict[str, dict[str, float]], dict]:
    """Each phase's floors on ``record``'s requests and batch (the last step's)."""
    from megatron_rl.schedules.runner import local_batch, model_inputs
    from megatron_rl.utils import dtypes
    from megatron_rl_lab.bench import step_floors as f
    from megatron_rl_lab.bench.step_phases import vllm_engine

    floors: dict[str, dict[str, float]] = {}
    facts: dict = {}
    if record.generate_calls:
        tokens: list[int] = []
        run = f.vllm_generate(vllm_engine(trainer), record.generate_calls, tokens)
        floors["generation"] = {"vllm_generate": f.median_seconds(run, repeats)}
        facts.update(generated_tokens=record.generated_tokens, floor_generated_tokens=tokens)
    batch = record.update_batch
    if batch is not None:
        chunks, micro = trainer.actor.chunks, trainer.micro
        if trainer.route_replay is not None:
            trainer.route_replay.begin(replay=False)
        forward_inputs = model_inputs(chunks, batch.plain(), micro)
        actor_batch, minis = batch.for_actor(), trainer.cfg.algorithm.mini_batches_per_step
        rows = actor_batch.num_rows // minis
        update_inputs = [
            x
            for m in range(minis)
            for x in model_inputs(chunks, local_batch(chunks, actor_batch.rows(m * rows, (m + 1) * rows), micro), micro)
        ]
        epochs = trainer.cfg.algorithm.ppo_epochs
        hf = f.transformers_model(trainer.base_dir, dtypes.to_torch(trainer.cfg.model.dtype))
        forward = {
            "megatron_forward": f.median_seconds(f.megatron_pass(chunks, forward_inputs, backward=False), repeats),
            "transformers_forward": f.median_seconds(f.transformers_pass(hf, forward_inputs, backward=False), repeats),
        }
        for phase in NO_GRAD_PHASES:
            floors[phase] = forward
        floors["update"] = {
            "megatron_forward_backward": epochs
            * f.median_seconds(f.megatron_pass(chunks, update_inputs, True), repeats),
            "transformers_forward_backward": epochs
            * f.median_seconds(f.transformers_pass(hf, update_inputs, backward=True), repeats),
        }
        facts.update(
            micro_batches_forward=len(forward_inputs),
            micro_batches_update=len(update_inputs) * epochs,
            tokens_forward=int(sum(t.numel() for t, _, _ in forward_inputs)),
        )
        del hf
    tensors = [p for chunk in trainer.actor.chunks for p in chunk.parameters()]
    sync_bytes, copy = f.byte_copy(tensors)
    floors["weight_sync"] = {"byte_copy": f.median_seconds(copy, repeats)}
    facts["weight_sync_bytes"] = sync_bytes
    return floors, facts


def run(plan: Plan) -> dict:
    from megatron_rl.config import load_config
    from megatron_rl.launch.signals import StopSignals
    from megatron_rl.trainer.trainer import RLTrainer
    from megatron_rl_lab.bench.step_phases import PhaseClock

    with tempfile.TemporaryDirectory(prefix="bench-step-") as run_dir:
        overrides = (*plan.overrides, f"trainer.max_steps={plan.steps}", f"trainer.run_dir={run_dir}")
        cfg = load_config(plan.config, overrides)
        clock = PhaseClock()
        with StopSignals() as stop:
            trainer = RLTrainer(cfg, stop)
            clock.install(trainer)
            trainer.run()
        phases, step_s = mean_phases(clock.steps)
        floors, facts = measure_floors(trainer, clock.steps[-1], plan.repeats)
    rows = phase_rows(phases, step_s, floors)
    result = {
        "bench": "step",
        "config": str(plan.config),
        "overrides": list(plan.overrides),
        "steps": plan.steps,
        "timed_steps": plan.steps - 1,
        "step_s": step_s,
        "rows": rows,
        **facts,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": host.node(),
    }
    print(table(rows))
    save_json(result, plan.json_path)
    return result


def table(rows: list[dict]) -> str:
    """The rows as a markdown table (docs/benchmarks.md keeps the measured ones)."""

    def number(x, digits=3):
        return "" if x is None else f"{x:.{digits}f}"

    lines = ["| phase | seconds | floor | floor seconds | ratio |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['phase']} | {number(r['seconds'])} | {r['floor'] or ''} | {number(r['floor_seconds'])} | "
            f"{number(r['ratio'], 2)} |"
        )
    return "\n".join(lines)


def run_args(args: argparse.Namespace) -> int:
    """``megatron-rl bench step``: the exit code."""
    return run_checked("step", lambda: make_plan(args, world_size()), run)
