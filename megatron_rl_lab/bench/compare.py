"""`megatron-rl bench compare SPEC`: N seeds x variants of a recipe, as curves with 95 %
intervals and comparisons at equal steps, at equal wall-clock and to a target.

The spec (:mod:`.compare_spec`) names a base recipe, overrides for every run, the seeds and
the variants. Every run starts from the same task base (``data.seed`` = the spec's
``base_seed``, built once into ``OUT/base_cache``), so seeds differ only in what the
trainer draws from ``trainer.seed``. The runs go one at a time (:mod:`.compare_runs`); a
comparison that is stopped, or outlives a session, goes on where it stopped when the same
command is run again: finished runs are skipped, crashed ones too (``--retry-failed``
reruns them) and counted per variant. The report (:mod:`.compare_report`, statistics in
:mod:`.seed_stats`) is ``OUT/compare.json`` and ``OUT/compare.png`` (:mod:`.compare_plot`),
rewritten after every invocation from whatever runs have finished.

A bad spec, an unknown filter, a run config the trainer would refuse or a run dir holding
another spec's run is one line and exit code 2 before anything runs. Exit 1: a selected run
has crashed (in this invocation or before); 75: stopped (Ctrl-C, or a run stopped by a
signal), run the same command again to go on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from megatron_rl.launch.exit_codes import STOPPED
from megatron_rl_lab.bench import compare_plot
from megatron_rl_lab.bench.args import BAD_ARGUMENTS, BenchArgumentError, bench_parser
from megatron_rl_lab.bench.compare_report import RunResult, build_report
from megatron_rl_lab.bench.compare_runs import (
    Interrupted,
    Run,
    RunOne,
    StaleRun,
    execute,
    plan_runs,
    read_marker,
    read_rows,
    run_env,
    run_overrides,
    subprocess_runner,
)
from megatron_rl_lab.bench.compare_spec import Spec, SpecError, load_spec

RUN_FAILED = 1
EPILOG = """\
spec (YAML; keys in megatron_rl_lab/bench/compare_spec.py):
  name: tppo_vs_ppo
  config: examples/ppo.yaml
  overrides: [data.source=task:digits_sum_work, trainer.max_steps=100]
  seeds: [1, 2, 3]
  variants:
    ppo: []
    tppo: [algorithm.recipe=tppo, "algorithm.overrides={generation_window: 8}"]
  target: {metric: reward/mean, value: 0.3, smooth: 5}

examples:
  megatron-rl bench compare spec.yaml --out runs/cmp --dry-run     # the commands, nothing run
  megatron-rl bench compare spec.yaml --out runs/cmp               # run (again: go on where it stopped)
  megatron-rl bench compare spec.yaml --out runs/cmp --seeds 1,2 --variants tppo
  megatron-rl bench compare spec.yaml --out runs/cmp --report-only # compare.json and .png from what exists
"""

MaxSteps = Callable[[str, Sequence[str]], int]
"""``max_steps(config, overrides)``: trainer.max_steps of a run that passes the trainer's
validation (BenchArgumentError otherwise)."""
Draw = Callable[[dict, str, Path], Path]
"""``draw(report, title, png path)``: :func:`.compare_plot.draw`."""


@dataclasses.dataclass(frozen=True)
class Plan:
    spec: Spec
    out: Path
    runs: tuple[Run, ...]
    """Every run of the spec (the report covers them all)."""
    selected: tuple[Run, ...]
    """The runs this invocation may execute (--seeds / --variants)."""
    dry_run: bool
    report_only: bool
    retry_failed: bool


def add_parser(sub) -> argparse.ArgumentParser:
    p = bench_parser(
        sub,
        "compare",
        help="N seeds x variants of a recipe: curves with 95%% intervals, equal-step and "
        "equal-time comparisons (resumable)",
        description=__doc__.split("\n\n")[0],
        epilog=EPILOG,
    )
    p.add_argument("spec", type=Path, help="the comparison's spec (YAML)")
    p.add_argument("--out", type=Path, default=None, help="results directory (default: runs/compare/<spec name>)")
    p.add_argument("--seeds", default=None, help="comma-separated: run only these of the spec's seeds")
    p.add_argument("--variants", default=None, help="comma-separated: run only these of the spec's variants")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print each run's command and state; run nothing")
    mode.add_argument("--report-only", action="store_true", help="rebuild compare.json and .png; run nothing")
    p.add_argument("--retry-failed", action="store_true", help="run the runs that crashed before again")
    return p


def config_max_steps(config: str, overrides: Sequence[str]) -> int:
    """Load and validate one run's config as the trainer would at world size 1."""
    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.from_config import validate  # imports torch: only for a real plan

    try:
        return validate(load_config(config, overrides), 1).trainer.max_steps
    except ConfigError as err:
        raise BenchArgumentError(str(err)) from None


def _filter(flag: str, text: Optional[str], allowed: Sequence, convert=str) -> set:
    if text is None:
        return set(allowed)
    try:
        chosen = {convert(x) for x in text.split(",") if x}
    except ValueError:
        chosen = set()
    if not chosen or not chosen <= set(allowed):
        raise BenchArgumentError(f"{flag} {text}: choose from the spec's {', '.join(map(str, allowed))}")
    return chosen


def make_plan(args: argparse.Namespace, max_steps: MaxSteps = config_max_steps) -> Plan:
    """Everything checked before anything runs (BenchArgumentError: one line, exit 2)."""
    try:
        spec = load_spec(args.spec)
    except SpecError as err:
        raise BenchArgumentError(str(err)) from None
    if not Path(spec.config).is_file():
        raise BenchArgumentError(
            f"{args.spec}: config: {spec.config} is not a file (paths are from the current directory)"
        )
    seeds = _filter("--seeds", args.seeds, spec.seeds, int)
    variants = _filter("--variants", args.variants, list(spec.variants))
    steps = {}
    for variant in spec.variants:  # trainer.seed changes no check: each variant is checked with one seed
        try:
            steps[variant] = max_steps(spec.config, run_overrides(spec, variant, spec.seeds[0]))
        except BenchArgumentError as err:
            raise BenchArgumentError(f"variant {variant}: {err}") from None
    out = args.out if args.out is not None else Path("runs/compare") / spec.name
    runs = tuple(plan_runs(spec, out, steps))
    try:
        for run in runs:
            read_marker(run)
    except StaleRun as err:
        raise BenchArgumentError(str(err)) from None
    selected = tuple(r for r in runs if r.seed in seeds and r.variant in variants)
    return Plan(spec, out, runs, selected, args.dry_run, args.report_only, args.retry_failed)


def run_entries(runs: Sequence[Run]) -> list[dict]:
    """Each run's state as compare.json lists it (a run with no marker is pending)."""
    out = []
    for run in runs:
        marker = read_marker(run) or {}
        out.append(
            {
                "variant": run.variant,
                "seed": run.seed,
                "run_dir": str(run.run_dir),
                "status": marker.get("status", "pending"),
                "exit_code": marker.get("exit_code"),
                "wall_s": marker.get("wall_s"),
                "steps": marker.get("steps"),
                "command": marker.get("command", shlex.join(run.command())),
            }
        )
    return out


def write_report(plan: Plan, draw: Draw = compare_plot.draw) -> dict:
    """compare.json and compare.png from the runs as they are now."""
    entries = run_entries(plan.runs)
    results = [
        RunResult(r.variant, r.seed, e["status"], tuple(read_rows(r.run_dir)) if e["status"] == "done" else ())
        for r, e in zip(plan.runs, entries)
    ]
    report = {"spec": plan.spec.to_dict(), "out": str(plan.out), "runs": entries, **build_report(plan.spec, results)}
    plan.out.mkdir(parents=True, exist_ok=True)
    tmp = plan.out / "compare.json.tmp"
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(plan.out / "compare.json")
    draw(report, plan.spec.name, plan.out / "compare.png")
    return report


def summary_lines(report: dict) -> list[str]:
    """A few lines per variant: the first metric's last-steps mean, the target, the crashes."""
    lines = []
    metric = report["metrics"][0] if report["metrics"] else None
    target = report.get("to_target")
    for variant, counts in report["crashes"].items():
        parts = [f"{variant}: {counts['done']} done, {counts['failed']} crashed, {counts['pending']} pending"]
        at = report["at_equal_steps"].get(metric, {}).get(variant) if metric else None
        if at and at["mean"] is not None:
            hw = "" if at["half_width"] is None else f" +/- {at['half_width']:.4g}"
            parts.append(f"{metric} (last steps) {at['mean']:.4g}{hw} (n={at['n']})")
        if target:
            t = target["variants"][variant]
            seconds = t["time_s"]["mean"]
            parts.append(
                f"target reached {t['reached']}/{t['of']}"
                + ("" if seconds is None else f" in {seconds:.1f} s, step {t['steps']['mean']:.1f} (mean)")
            )
        lines.append("; ".join(parts))
    return lines


def run(plan: Plan, run_one: RunOne = subprocess_runner, draw: Draw = compare_plot.draw, say=print) -> int:
    """Run what is selected and not finished, then write the report; the exit code."""
    if plan.dry_run:
        for run_ in plan.selected:
            state = (read_marker(run_) or {}).get("status", "pending")
            say(f"# {run_.label}: {state}\n{shlex.join(run_.command())}")
        return 0
    code = 0
    try:
        if not plan.report_only:
            execute(plan.selected, run_one, run_env(plan.out), plan.retry_failed, say)
    except (Interrupted, KeyboardInterrupt) as err:
        say(f"megatron-rl bench compare: stopped: {str(err) or 'Ctrl-C'}; run the same command again to go on")
        code = STOPPED
    report = write_report(plan, draw)
    for line in summary_lines(report):
        say(line)
    say(f"{plan.out / 'compare.json'}\n{plan.out / 'compare.png'}")
    failed = [r for r in plan.selected if (read_marker(r) or {}).get("status") == "failed"]
    return code or (RUN_FAILED if failed and not plan.report_only else 0)


def run_args(
    args: argparse.Namespace,
    run_one: RunOne = subprocess_runner,
    max_steps: MaxSteps = config_max_steps,
    draw: Draw = compare_plot.draw,
) -> int:
    """``megatron-rl bench compare``: the exit code. The runner, the config check and the
    plot are parameters so that the harness is tested without a trainer (or a plot)."""
    try:
        plan = make_plan(args, max_steps)
    except BenchArgumentError as err:
        print(f"megatron-rl bench compare: error: {err}", file=sys.stderr)
        return BAD_ARGUMENTS
    return run(plan, run_one, draw)
