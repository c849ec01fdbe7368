"""Rollouts ahead of training: the same GRPO run colocated, disaggregated in lockstep
(``rollout.max_staleness=0``), disaggregated one batch ahead (``max_staleness=1``), and one
batch ahead with partial rollouts (``rollout.partial``).

The bench is not launched under torchrun: it launches the trainer once per mode itself, one
torchrun each, every run in a run directory of its own under ``--dir``, with the same recipe
(examples/grpo.yaml: GRPO on the embedded digit task, the tiny MoE actor, each run building
the same warmed-up base), the same seed, the same step count and per-prompt sampling seeds
(``rollout.seed_per_prompt=true``, so all sample alike; ``--task`` picks a task with longer
answers, so that generation is a larger share of a step):

- ``colocated``: world = training ranks; every rank generates, then trains.
- ``disaggregated_k0``: world = training + rollout ranks; the rollout ranks generate while
  the training ranks wait, then the reverse.
- ``disaggregated_k1``: the same launch, the next batch generated while the training ranks
  update (samples one policy version old).
- ``disaggregated_k1_partial``: the same, generating ``--partial-chunk-tokens`` at a time, so
  a batch still generating when the update's weights arrive goes on under them.

All use token TIS (cap 2), which k > 0 needs, so the losses are the same
function; at k = 0 its weights are ~1. Each rank runs one thread (OMP_NUM_THREADS=1): with
one training and one rollout rank on two cores, each side has a core of its own, and what
k = 1 can gain is the rollout core's time that lockstep leaves idle.

Throughput is the total over steps 2..N of the tokens each step generated and trained
(``throughput/tokens_per_s x timing/step_s``: the trainer's own count) divided by the total
of their step times, not the mean of the per-step rates: a mean of rates weights a short
step like a long one and overstates what a run achieves when step times vary. Step 1 is
left out of every mean: it pays one-time costs (the engines' first batch, the optimizer's
first step), and at k = 1 it has nothing in flight yet, so it is synchronous by construction.
Trained samples per second are reported beside it: all modes train the same samples per
step, so that ratio does not move when one mode's policy drifts to longer or shorter answers.
:func:`summarize` turns the runs' metrics.jsonl rows into the JSON (a pure function).

    megatron-rl bench async --dir runs/bench-async --json bench_async.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform as host
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from megatron_rl_lab.bench.args import (
    BenchArgumentError,
    bench_parser,
    positive,
    run_checked,
    save_json,
    world_size,
)

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "grpo.yaml"
CORRECTION = "algorithm.overrides={rollout_correction: {kind: token_tis, cap: 2.0}}"
"""What max_staleness > 0 requires; every mode uses it, so all train with the same loss."""
MODES = {
    "colocated": None,
    "disaggregated_k0": (0, False),
    "disaggregated_k1": (1, False),
    "disaggregated_k1_partial": (1, True),
}
"""mode -> (rollout.max_staleness, rollout.partial) (None: colocated)."""
FIRST_STEP = 2
"""Steps before this one are left out of the means (one-time costs; k = 1 has nothing in flight)."""
EPILOG = """\
examples:
  megatron-rl bench async --json bench_async.json                 # 1 training + 1 rollout rank
  megatron-rl bench async --train-ranks 2 --rollout-ranks 2 --dir runs/bench-async-w4
  megatron-rl bench async --task digits_max_work --max-new-tokens 160 --prompts-per-step 8 \\
      --set trainer.seq_length=192 --set trainer.lr=0.0003       # answers ~7x the prompt
  python tools/bench_async.py   # the same, with a markdown table
"""


class LaunchFailed(RuntimeError):
    """A trainer launch exited non-zero or timed out (its log is kept in the bench's directory)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    steps: int
    train_ranks: int
    rollout_ranks: int
    prompts_per_step: int
    n_samples: int
    max_new_tokens: int
    task: str
    partial_chunk_tokens: int
    modes: tuple[str, ...]
    extra_overrides: tuple[str, ...]
    seed: int
    dir: Path
    json_path: Optional[Path]
    timeout_s: float


@dataclasses.dataclass(frozen=True)
class Launch:
    """One trainer run of the bench: its world size and its config overrides."""

    mode: str
    world: int
    run_dir: Path
    overrides: tuple[str, ...]
    """Everything but trainer.run_dir."""

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={self.world}",
            "-m",
            "megatron_rl",
            "train",
            "--config",
            str(RECIPE),
            *self.config_overrides(),
        ]

    def config_overrides(self) -> tuple[str, ...]:
        return (f"trainer.run_dir={self.run_dir}", *self.overrides)


def add_parser(sub) -> argparse.ArgumentParser:
    from megatron_rl.config.schema import RolloutConfig

    p = bench_parser(
        sub,
        "async",
        help="colocated vs disaggregated rollouts at max_staleness 0 and 1, and 1 with "
        "partial rollouts (launches torchrun)",
        description=__doc__.split("\n\n")[0],
        epilog=EPILOG,
    )
    p.add_argument("--steps", type=positive, default=8, help="training steps of each run (means over steps 2..N)")
    p.add_argument("--train-ranks", type=positive, default=1, help="training ranks (the colocated run's world size)")
    p.add_argument("--rollout-ranks", type=positive, default=1, help="vLLM ranks added in the disaggregated runs")
    p.add_argument("--prompts-per-step", type=positive, default=64, help="rollout.prompts_per_step")
    p.add_argument("--n-samples", type=positive, default=8, help="rollout.n_samples (GRPO's group size)")
    p.add_argument("--max-new-tokens", type=positive, default=16, help="rollout.max_new_tokens")
    p.add_argument(
        "--task",
        default="digits_max",
        help="the synthetic task (data.source=task:NAME); "
        "digits_max_steps answers in ~9 tokens, digits_max_work in ~95 (with --set trainer.seq_length=192)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every run, after the bench's own (repeatable; e.g. "
        "trainer.seq_length=112 for a task whose prompt and answer need it)",
    )
    p.add_argument(
        "--partial-chunk-tokens",
        type=positive,
        default=RolloutConfig.partial_chunk_tokens,
        help="rollout.partial_chunk_tokens (default: the config's)",
    )
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--seed", type=int, default=1234, help="trainer.seed of every run")
    p.add_argument(
        "--dir",
        type=Path,
        default=Path("runs/bench-async"),
        help="the run directories go here (must not exist or be empty; kept)",
    )
    p.add_argument("--timeout", type=positive, default=1800, help="seconds one launch may take")
    p.add_argument("--json", default=None, help="write the result here")
    return p


def make_plan(args: argparse.Namespace, world: int) -> Plan:
    if world != 1:
        raise BenchArgumentError(
            f"bench async launches its own torchrun runs; run it in one process, not WORLD_SIZE={world}"
        )
    if args.steps < FIRST_STEP:
        raise BenchArgumentError(
            f"--steps {args.steps}: the means start at step {FIRST_STEP}; pass --steps >= {FIRST_STEP}"
        )
    if args.dir.exists() and (not args.dir.is_dir() or any(args.dir.iterdir())):
        raise BenchArgumentError(
            f"--dir {args.dir} exists and is not an empty directory; pass a new or empty one "
            "(a trainer finding a run dir of its own there would resume from it)"
        )
    modes = tuple(m for m in args.modes.split(",") if m)
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise BenchArgumentError(f"--modes {args.modes!r}: choose from {', '.join(MODES)}")
    plan = Plan(
        steps=args.steps,
        train_ranks=args.train_ranks,
        rollout_ranks=args.rollout_ranks,
        prompts_per_step=args.prompts_per_step,
        n_samples=args.n_samples,
        max_new_tokens=args.max_new_tokens,
        task=args.task,
        partial_chunk_tokens=args.partial_chunk_tokens,
        modes=modes,
        extra_overrides=tuple(args.set),
        seed=args.seed,
        dir=args.dir,
        json_path=Path(args.json) if args.json else None,
        timeout_s=float(args.timeout),
    )
    check_configs(plan)
    return plan


def launches(plan: Plan) -> list[Launch]:
    """The runs of ``plan.modes``, in the order they are launched."""
    common = (
        f"trainer.max_steps={plan.steps}",
        f"trainer.seed={plan.seed}",
        "rollout.seed_per_prompt=true",
        f"rollout.prompts_per_step={plan.prompts_per_step}",
        f"rollout.n_samples={plan.n_samples}",
        f"rollout.max_new_tokens={plan.max_new_tokens}",
        f"data.source=task:{plan.task}",
        CORRECTION,
        *plan.extra_overrides,
    )
    out = []
    for mode in plan.modes:
        if MODES[mode] is None:
            out.append(Launch(mode, plan.train_ranks, plan.dir / mode, common))
            continue
        staleness, partial = MODES[mode]
        extra = ("rollout.partial=true", f"rollout.partial_chunk_tokens={plan.partial_chunk_tokens}") if partial else ()
        out.append(
            Launch(
                mode,
                plan.train_ranks + plan.rollout_ranks,
                plan.dir / mode,
                (
                    *common,
                    "rollout.placement=disaggregated",
                    f"rollout.num_ranks={plan.rollout_ranks}",
                    f"rollout.max_staleness={staleness}",
                    *extra,
                ),
            )
        )
    return out


def check_configs(plan: Plan) -> None:
    """Each run's config passes the trainer's own validation at its world size (a layout
    the training ranks cannot hold, a batch that does not split): one line before any launch."""
    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.from_config import validate

    for launch in launches(plan):
        try:
            validate(load_config(RECIPE, launch.config_overrides()), launch.world)
        except ConfigError as err:
            raise BenchArgumentError(f"{launch.mode} (world {launch.world}): {err}") from None


# -- the summary (pure: metrics rows in, JSON-able dict out) ----------------------------------


def _mean(rows: Sequence[dict], key: str) -> Optional[float]:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def summarize_mode(rows: Sequence[dict], first_step: int = FIRST_STEP, n_samples: Optional[int] = None) -> dict:
    """One run's numbers from its metrics.jsonl rows; means over steps >= ``first_step``.
    Keys a placement does not log (colocated: no overlap, idle or staleness) are None.
    ``rollout_s`` is the step's rollout phase as the training ranks saw it (colocated: generating
    and scoring; disaggregated: waiting for the batch and scoring it). ``rollout_idle_s`` is
    the trainer's metric (the rollout ranks' waits for commands since their previous
    generation); ``rollout_busy_fraction`` is the share of the timed steps they spent generating.
    ``samples_per_s`` counts trained samples (``rollout/kept_groups`` x ``n_samples``; None
    without ``n_samples``): unlike tokens/s it does not move when one mode's policy drifts to
    longer or shorter answers."""
    timed = [r for r in rows if r["step"] >= first_step]
    if not timed:
        raise ValueError(f"no metrics rows from step {first_step} on (steps logged: {[r['step'] for r in rows]})")
    tokens = sum(r["throughput/tokens_per_s"] * r["timing/step_s"] for r in timed)
    seconds = sum(r["timing/step_s"] for r in timed)
    staleness = [r["rollout/staleness_max"] for r in timed if "rollout/staleness_max" in r]
    generated = [r["timing/generation_s"] for r in timed if "timing/generation_s" in r]
    kept = [r["rollout/kept_groups"] for r in timed if "rollout/kept_groups" in r]
    return {
        "steps": len(rows),
        "timed_steps": len(timed),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "samples_per_s": sum(kept) * n_samples / seconds if n_samples and len(kept) == len(timed) else None,
        "step_s": _mean(timed, "timing/step_s"),
        "train_s": _mean(timed, "timing/train_s"),
        "rollout_s": _mean(timed, "timing/rollout_s"),
        "generation_s": _mean(timed, "timing/generation_s"),
        "overlap_fraction": _mean(timed, "timing/overlap_fraction"),
        "train_idle_s": _mean(timed, "timing/train_idle_s"),
        "rollout_idle_s": _mean(timed, "timing/rollout_idle_s"),
        "rollout_busy_fraction": sum(generated) / seconds if generated else None,
        "staleness_mean": _mean(timed, "rollout/staleness_mean"),
        "staleness_max": max(staleness, default=None),
        "partial_samples": _mean(timed, "rollout/partial_samples"),
        "response_length": _mean(timed, "response_length/mean"),
        "reward_curve": [r["reward/mean"] for r in rows],
    }


def summarize(
    rows_by_mode: dict[str, Sequence[dict]], first_step: int = FIRST_STEP, n_samples: Optional[int] = None
) -> dict:
    """Per-mode numbers and the ratios between the modes run: tokens/s (``speedup_<a>_vs_<b>``)
    and trained samples/s (``speedup_samples_<a>_vs_<b>``)."""
    modes = {mode: summarize_mode(rows, first_step, n_samples) for mode, rows in rows_by_mode.items()}
    pairs = [("k1", "k0"), ("k1_partial", "k0"), ("k1_partial", "k1"), ("k0", "colocated"), ("k1", "colocated")]
    name = {"colocated": "colocated", **{m.removeprefix("disaggregated_"): m for m in MODES if m != "colocated"}}
    ratios = {}
    for prefix, key in (("speedup", "tokens_per_s"), ("speedup_samples", "samples_per_s")):
        rate = {mode: m[key] for mode, m in modes.items() if m[key] is not None}
        ratios.update(
            {
                f"{prefix}_{a}_vs_{b}": rate[name[a]] / rate[name[b]]
                for a, b in pairs
                if name[a] in rate and name[b] in rate
            }
        )
    return {
        "modes": modes,
        **ratios,
        "tokens_per_s_is": f"sum over steps {first_step}..N of throughput/tokens_per_s x timing/step_s "
        "(generated + trained tokens) / sum of timing/step_s",
    }


# -- the launches ------------------------------------------------------------------------------


def launch_one(launch: Launch, log: Path, timeout_s: float) -> tuple[list[dict], float]:
    """Run one trainer launch (one thread per rank): its metrics rows and its wall time."""
    # The tests' launcher: on a timeout it kills the whole session, vLLM workers included.
    from megatron_rl_lab.testing.torchrun import run_process_group

    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    try:
        proc = run_process_group(launch.command(), env, timeout_s)
    except subprocess.TimeoutExpired as err:
        log.write_text((err.output or "") + (err.stderr or ""))
        raise LaunchFailed(f"{launch.mode} did not finish in --timeout {timeout_s:.0f} s ({log})") from None
    wall = time.perf_counter() - started
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
        raise LaunchFailed(f"{launch.mode} exited {proc.returncode} after {wall:.0f} s ({log}): {tail[0]}")
    metrics = launch.run_dir / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()], wall


def run(plan: Plan) -> dict:
    plan.dir.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    rows, runs = {}, {}
    for launch in launches(plan):
        load = os.getloadavg()
        print(f"bench async: {launch.mode} (world {launch.world}) ...", file=sys.stderr, flush=True)
        rows[launch.mode], wall = launch_one(launch, plan.dir / f"{launch.mode}.log", plan.timeout_s)
        runs[launch.mode] = {
            "world": launch.world,
            "wall_s": wall,
            "loadavg_start": load,
            "loadavg_end": os.getloadavg(),
            "command": shlex.join(launch.command()),
        }
    result = {
        "bench": "async",
        "recipe": str(RECIPE.relative_to(RECIPE.parents[1])),
        **summarize(rows, n_samples=plan.n_samples),
        "runs": runs,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(plan).items()},
        "date": started.isoformat(timespec="seconds"),
        "command": shlex.join(["megatron-rl", *sys.argv[1:]]),
        "machine": {
            "host": host.node(),
            "cpus": os.cpu_count(),
            "platform": host.platform(),
            "python": host.python_version(),
        },
    }
    print(json.dumps(result, indent=1))
    save_json(result, plan.json_path)
    return result


def run_args(args: argparse.Namespace) -> int:
    """``megatron-rl bench async``: the exit code (1 if a launch failed)."""
    try:
        return run_checked("async", lambda: make_plan(args, world_size()), run)
    except LaunchFailed as err:
        print(f"megatron-rl bench async: {err}", file=sys.stderr)
        return 1
