"""`megatron-rl bench grpo-reference`: is our GRPO the plain GRPO learner? Train it over
seeds with ``trainer.save_rollouts``, replay every step's rows through a plain reference
(transformers + the formula in torch + torch's AdamW, :mod:`.grpo_replay`), and compare the
two policies' logprobs of each step's samples before that step's update.

Each seed is one ``megatron-rl train`` in a process of its own, in ``OUT/runs/grpo/seed<S>``
(the runs of :mod:`.compare_runs`: one at a time, ``done.json`` when one ends, finished runs
skipped when the same command is run again, task bases built once into ``OUT/base_cache``:
each seed's own from its ``trainer.seed``, or one for all from ``data.seed`` =
``--base-seed``). The replay of a seed runs in this process once its run has finished.
``OUT/grpo_reference.json`` holds every seed's steps and the summary: per step, the mean over
seeds with its 95 % Student-t interval (:mod:`.seed_stats`). A recipe with pieces the
reference does not write, or a run config the trainer would refuse, is one line and exit
code 2 before anything runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from megatron_rl.launch.exit_codes import STOPPED
from megatron_rl_lab.bench.args import BAD_ARGUMENTS, BenchArgumentError, bench_parser, positive, positive_list
from megatron_rl_lab.bench.compare_runs import (
    Interrupted,
    Run,
    RunOne,
    StaleRun,
    execute,
    read_marker,
    run_env,
    subprocess_runner,
)
from megatron_rl_lab.bench.seed_stats import mean_interval

RUN_FAILED = 1
VARIANT = "grpo"
RESULT = "grpo_reference.json"
SUMMED = (
    "logp_abs_diff_mean",
    "logp_abs_diff_max",
    "moved_mean",
    "twin_vs_ref_mean",
    "twin_vs_ref_max",
    "fp64_vs_ref_mean",
    "fp64_vs_ours_mean",
    "fp64_vs_ref_max",
    "fp64_vs_ours_max",
)
"""Per-step values summarised over seeds."""
EPILOG = """\
examples:
  megatron-rl bench grpo-reference --seeds 1 --steps 5 --out runs/grpo_reference_dev
  megatron-rl bench grpo-reference --seeds 1,2,3 --steps 20 --out runs/grpo_reference
  megatron-rl bench grpo-reference --config examples/dapo.yaml --set rollout.n_samples=4
  megatron-rl bench grpo-reference --out runs/grpo_reference --replay-only   # the runs exist
"""


@dataclasses.dataclass(frozen=True)
class Plan:
    config: str
    overrides: tuple[str, ...]
    """Every run's, but the seed's and the run dir."""
    seeds: tuple[int, ...]
    steps: int
    out: Path
    replay_only: bool
    control: bool

    def run(self, seed: int) -> Run:
        run_dir = self.out / "runs" / VARIANT / f"seed{seed}"
        return Run(VARIANT, seed, self.config, (*self.overrides, f"trainer.seed={seed}"), run_dir, self.steps)


def add_parser(sub) -> argparse.ArgumentParser:
    p = bench_parser(
        sub,
        "grpo-reference",
        help="GRPO against a plain reference (transformers + torch AdamW) on the same samples, over seeds",
        description=__doc__.split("\n\n")[0],
        epilog=EPILOG,
    )
    p.add_argument("--config", default="examples/grpo.yaml", help="the recipe (default: examples/grpo.yaml)")
    p.add_argument("--seeds", type=positive_list(int, "1,2,3"), default=[1, 2, 3], help="trainer.seed of each run")
    p.add_argument("--steps", type=positive, default=20, help="trainer.max_steps of each run (default 20)")
    p.add_argument(
        "--base-seed",
        type=int,
        default=None,
        help="data.seed of every run: one task base for all seeds (default: not set, each run's base "
        "comes from its trainer.seed, as `train ... trainer.seed=S` alone builds it)",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeat)")
    p.add_argument("--out", type=Path, default=Path("runs/grpo_reference"), help="results directory")
    p.add_argument("--replay-only", action="store_true", help="replay the finished runs; train nothing")
    p.add_argument(
        "--no-control", action="store_true", help="skip the float64 reference and the fp32 twin (the noise floor)"
    )
    return p


def run_config(config: str, overrides: Sequence[str]):
    """One run's config, validated as the trainer would at world size 1 and checked against
    what the reference writes (BenchArgumentError otherwise)."""
    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.from_config import validate  # imports torch: only for a real plan
    from megatron_rl_lab.bench.grpo_replay import ReplayError, check_supported

    try:
        cfg = validate(load_config(config, overrides), 1)
        check_supported(cfg)
    except (ConfigError, ReplayError) as err:
        raise BenchArgumentError(str(err)) from None
    return cfg


def make_plan(args: argparse.Namespace, check: Callable = run_config) -> Plan:
    """Everything checked before anything runs (BenchArgumentError: one line, exit 2)."""
    if not Path(args.config).is_file():
        raise BenchArgumentError(f"--config {args.config} is not a file")
    owned = ("trainer.seed=", "trainer.run_dir=", "trainer.max_steps=", "trainer.save_rollouts=", "data.seed=")
    for override in args.set:
        if override.startswith(owned):
            raise BenchArgumentError(f"--set {override}: the bench sets {override.split('=')[0]} itself")
    overrides = (*args.set, f"trainer.max_steps={args.steps}", "trainer.save_rollouts=true")
    if args.base_seed is not None:
        overrides += (f"data.seed={args.base_seed}",)
    check(args.config, (*overrides, f"trainer.seed={args.seeds[0]}"))
    plan = Plan(args.config, overrides, tuple(args.seeds), args.steps, args.out, args.replay_only, not args.no_control)
    try:
        for seed in plan.seeds:
            read_marker(plan.run(seed))
    except StaleRun as err:
        raise BenchArgumentError(str(err)) from None
    return plan


def base_dir(cfg, out: Path) -> Path:
    """The HF directory the run started from: model.hf_path, or the task base in OUT/base_cache
    (where :func:`.compare_runs.run_env` points the runs' base cache)."""
    from megatron_rl.from_config.setup import base_model_path

    return base_model_path(cfg, str(Path(out).resolve() / "base_cache"))


def replay_seed(plan: Plan, seed: int, say=print) -> list[dict]:
    """The reference's replay of one finished run."""
    from megatron_rl.config import load_config
    from megatron_rl_lab.bench.grpo_replay import replay_run, replay_settings

    run_dir = plan.run(seed).run_dir
    cfg = load_config(run_dir / "config.yaml")
    return replay_run(run_dir, base_dir(cfg, plan.out), plan.steps, replay_settings(cfg), plan.control, say)


def summarize(per_seed: dict[int, list[dict]]) -> dict:
    """Per step, each of :data:`SUMMED` as the mean over seeds with its 95 % interval; and the
    checks that must hold at every step of every seed (advantages, loss tokens)."""
    steps = sorted({r["step"] for rows in per_seed.values() for r in rows})
    by_step = {s: [r for rows in per_seed.values() for r in rows if r["step"] == s] for s in steps}
    curves = {}
    for key in SUMMED:
        points = [mean_interval([r[key] for r in by_step[s] if key in r]) for s in steps]
        if any(p is not None for p in points):
            curves[key] = [{"step": s, **p.to_dict()} for s, p in zip(steps, points) if p is not None]
    every = [r for rows in per_seed.values() for r in rows]
    return {
        "seeds": sorted(per_seed),
        "steps": steps,
        "per_step": curves,
        "advantage_max_abs_diff": max((r["advantage_max_abs_diff"] for r in every), default=None),
        "loss_mask_mismatch": sum(r["loss_mask_mismatch"] for r in every),
        "grad_norm_max_rel_diff": _max_rel(every, "ref_grad_norm", "ours_grad_norm"),
        "pg_loss_max_abs_diff": _max_abs(every, "ref_pg_loss", "ours_pg_loss"),
        "clipfrac_max_abs_diff": _max_abs(every, "ref_clipfrac", "ours_clipfrac"),
    }


def _max_abs(rows: Sequence[dict], ref: str, ours: str) -> Optional[float]:
    pairs = [(r[ref], r[ours]) for r in rows if r.get(ours) is not None]
    return max((abs(a - b) for a, b in pairs), default=None)


def _max_rel(rows: Sequence[dict], ref: str, ours: str) -> Optional[float]:
    pairs = [(r[ref], r[ours]) for r in rows if r.get(ours)]
    return max((abs(a - b) / abs(b) for a, b in pairs), default=None)


def summary_lines(summary: dict) -> list[str]:
    """One line per step: the mean |Δ logp| over seeds (and its interval), then the checks."""
    curves = summary["per_step"]
    lines = [f"seeds {summary['seeds']}: |logp_ref - old_logprobs| over loss tokens, mean over seeds (95 % CI)"]
    for i, step in enumerate(summary["steps"]):
        parts = [f"step {step:3d}"]
        for key in SUMMED:
            if key in curves and i < len(curves[key]):
                point = curves[key][i]
                hw = "" if point["half_width"] is None else f" +/- {point['half_width']:.1e}"
                parts.append(f"{key} {point['mean']:.2e}{hw}")
        lines.append("  ".join(parts))
    lines.append(
        f"advantages max |diff| {summary['advantage_max_abs_diff']:.1e}; loss-token mismatches "
        f"{summary['loss_mask_mismatch']}; grad_norm max rel diff {_fmt(summary['grad_norm_max_rel_diff'])}; "
        f"pg_loss max |diff| {_fmt(summary['pg_loss_max_abs_diff'])}; "
        f"clipfrac max |diff| {_fmt(summary['clipfrac_max_abs_diff'])}"
    )
    return lines


def _fmt(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.1e}"


def write_result(plan: Plan, per_seed: dict[int, list[dict]]) -> dict:
    """OUT/grpo_reference.json, written aside and renamed."""
    result = {
        "config": plan.config,
        "overrides": list(plan.overrides),
        "commands": {seed: " ".join(plan.run(seed).command()) for seed in per_seed},
        "per_seed": {str(seed): rows for seed, rows in per_seed.items()},
        "summary": summarize(per_seed),
    }
    plan.out.mkdir(parents=True, exist_ok=True)
    tmp = plan.out / (RESULT + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(plan.out / RESULT)
    return result


def run(plan: Plan, run_one: RunOne = subprocess_runner, replay=replay_seed, say=print) -> int:
    """Train each seed (unless it has finished before), replay it, then write the result."""
    per_seed: dict[int, list[dict]] = {}
    code = 0
    runs = [plan.run(seed) for seed in plan.seeds]
    try:
        for run_ in runs:
            if not plan.replay_only:
                execute([run_], run_one, run_env(plan.out), say=say)
            marker = read_marker(run_) or {}
            if marker.get("status") != "done":
                say(f"{run_.label}: {marker.get('status', 'not run')}; not replayed")
                code = RUN_FAILED
                continue
            say(f"{run_.label}: replaying {plan.steps} steps through the reference")
            per_seed[run_.seed] = replay(plan, run_.seed, say)
    except (Interrupted, KeyboardInterrupt) as err:
        say(f"megatron-rl bench grpo-reference: stopped: {str(err) or 'Ctrl-C'}; run the same command again to go on")
        code = STOPPED
    if per_seed:
        result = write_result(plan, per_seed)
        for line in summary_lines(result["summary"]):
            say(line)
        say(str(plan.out / RESULT))
    return code


def run_args(args: argparse.Namespace, run_one: RunOne = subprocess_runner, check: Callable = run_config) -> int:
    """``megatron-rl bench grpo-reference``: the exit code (the runner and the config check
    are parameters so that the harness is tested without a trainer)."""
    try:
        plan = make_plan(args, check)
    except BenchArgumentError as err:
        print(f"megatron-rl bench grpo-reference: error: {err}", file=sys.stderr)
        return BAD_ARGUMENTS
    return run(plan, run_one)
