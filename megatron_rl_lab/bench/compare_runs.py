"""The runs of a `megatron-rl bench compare`, one at a time, and what is known of each.

Every (variant, seed) is one ``megatron-rl train`` in a process of its own, in
``OUT/runs/<variant>/seed<S>``, with its output appended to ``train.log`` there. When a
run ends, the harness writes ``done.json`` beside it (atomically: tmp + rename) with its
exit code, wall seconds (of this last attempt), command and whether it finished (exit 0 and one metrics row per
step 1..trainer.max_steps). That marker is the whole resume state:

- a marker that says ``done``: skipped;
- a marker that says ``failed``: skipped and counted as a crash (``retry_failed``: run again);
- no marker (never started, or the harness stopped inside it): run, with the same command
  in the same run dir. The trainer itself resumes from the newest checkpoint it committed
  there and drops the metrics rows past it (trainer.state, launch.resume); with none it
  starts afresh, so nothing of an interrupted attempt leaks into the curves.

A run stopped by a signal (exit 75 after a checkpoint, or killed by SIGINT / SIGTERM) is
not a crash: the harness stops with :class:`Interrupted` and leaves it unmarked, so the
next invocation goes on from it. How a run is executed is a function passed in
(:data:`RunOne`), so the harness is tested without a trainer.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from megatron_rl.launch.exit_codes import STOPPED
from megatron_rl_lab.bench.compare_spec import Spec

MARKER = "done.json"
LOG = "train.log"
METRICS = "metrics.jsonl"
STOP_CODES = frozenset({STOPPED, 128 + signal.SIGINT, 128 + signal.SIGTERM, -signal.SIGINT, -signal.SIGTERM})
"""Exit codes of a run stopped from outside (a checkpoint was or may have been committed):
the run is resumed next time, not counted as a crash. Negative: subprocess's signal deaths."""
STOP_GRACE_S = 120.0
"""How long the harness waits, after Ctrl-C, for the run to commit its checkpoint and exit
before killing it."""

SHARED_CACHES = {"VLLM_CACHE_ROOT": "vllm", "TORCHINDUCTOR_CACHE_DIR": "inductor"}
"""Compile caches the runs share (variable -> directory under OUT/cache)."""

RunOne = Callable[[Sequence[str], Path, Mapping[str, str]], tuple[int, float]]
"""``run_one(command, run_dir, env) -> (exit code, wall seconds)``: executes one run."""


class Interrupted(RuntimeError):
    """A run was stopped from outside; the comparison goes on from it next time."""


class StaleRun(ValueError):
    """A run dir's marker records another command than the spec's for that run."""


@dataclasses.dataclass(frozen=True)
class Run:
    """One (variant, seed) of the comparison."""

    variant: str
    seed: int
    config: str
    """The recipe as the spec names it."""
    overrides: tuple[str, ...]
    """Everything after ``--config`` but ``trainer.run_dir``."""
    run_dir: Path
    max_steps: int

    @property
    def label(self) -> str:
        return f"{self.variant}/seed{self.seed}"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "megatron_rl",
            "train",
            "--config",
            str(Path(self.config).resolve()),
            *self.overrides,
            f"trainer.run_dir={self.run_dir}",
        ]

    def identity(self) -> dict:
        """What makes two invocations' run the same run (the marker keeps it)."""
        return {"config": self.config, "overrides": list(self.overrides), "max_steps": self.max_steps}


def run_overrides(spec: Spec, variant: str, seed: int) -> tuple[str, ...]:
    """The spec's overrides, the variant's, then what the harness sets (seed, shared base)."""
    base = () if spec.base_seed is None else (f"data.seed={spec.base_seed}",)
    return (*spec.overrides, *spec.variants[variant], f"trainer.seed={seed}", *base)


def plan_runs(spec: Spec, out: Path, max_steps: Mapping[str, int]) -> list[Run]:
    """Every run, seed by seed (each seed's variants together, so a comparison stopped
    half-way already compares its first seeds); ``max_steps``: each variant's trainer.max_steps."""
    return [
        Run(
            variant,
            seed,
            spec.config,
            run_overrides(spec, variant, seed),
            out / "runs" / variant / f"seed{seed}",
            max_steps[variant],
        )
        for seed in spec.seeds
        for variant in spec.variants
    ]


def run_env(out: Path, base: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The runs' environment: the caller's, a base cache under ``out`` (a task base is built
    by the first run that needs it and read by the rest), vLLM's and inductor's caches shared
    too unless the caller set them (both content-keyed and written atomically, as the test
    session shares them: each run would otherwise compile from cold), no model hub."""
    env = dict(os.environ if base is None else base)
    root = Path(out).resolve()
    # imported here: the tasks import the rule verifiers (math_verify), which the GPU kit's
    # bare machine lacks, and the bench's parser imports this module for every subcommand
    from megatron_rl.tasks.base_model import BASE_CACHE_ENV

    env.update({BASE_CACHE_ENV: str(root / "base_cache"), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    for name, directory in SHARED_CACHES.items():
        env.setdefault(name, str(root / "cache" / directory))
    return env


# -- what is known of a run ----------------------------------------------------------------


def read_marker(run: Run) -> Optional[dict]:
    """The run's marker, None when it has none; :class:`StaleRun` when it is another run's."""
    path = run.run_dir / MARKER
    if not path.is_file():
        return None
    marker = json.loads(path.read_text())
    if marker.get("identity") != run.identity():
        raise StaleRun(
            f"{run.run_dir} holds a run of another spec ({MARKER}: {marker.get('identity')}); "
            "pass another --out, or delete that run dir to run it again"
        )
    return marker


def write_marker(run_dir: Path, marker: dict) -> None:
    """Atomically: a reader sees the old marker, or none, or the whole new one."""
    tmp = run_dir / (MARKER + ".tmp")
    tmp.write_text(json.dumps(marker, indent=1) + "\n")
    os.replace(tmp, run_dir / MARKER)


def read_rows(run_dir: Path) -> list[dict]:
    """The run's metrics rows in order; a torn or non-row line (a killed attempt) is skipped."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def trained_steps(rows: Sequence[dict]) -> int:
    """How many of the steps 1, 2, ... the rows hold without a gap (step 0 is the eval of the
    starting weights)."""
    steps = {row["step"] for row in rows}
    count = 0
    while count + 1 in steps:
        count += 1
    return count


# -- running -----------------------------------------------------------------------------


def execute(
    runs: Sequence[Run],
    run_one: RunOne,
    env: Mapping[str, str],
    retry_failed: bool = False,
    say: Callable[[str], None] = print,
) -> None:
    """Run every run that has no marker (and the failed ones with ``retry_failed``), one at a
    time, marking each as it ends. Raises :class:`Interrupted` at a run stopped from outside."""
    for index, run in enumerate(runs, start=1):
        marker = read_marker(run)
        where = f"[{index}/{len(runs)}] {run.label}"
        if marker is not None and (marker["status"] == "done" or not retry_failed):
            say(f"{where}: {marker['status']} before (exit {marker['exit_code']}), skipped")
            continue
        run.run_dir.mkdir(parents=True, exist_ok=True)
        (run.run_dir / MARKER).unlink(missing_ok=True)
        say(f"{where}: running ({run.run_dir / LOG})")
        code, seconds = run_one(run.command(), run.run_dir, env)
        if code in STOP_CODES:
            raise Interrupted(f"{run.label} was stopped (exit {code})")
        steps = trained_steps(read_rows(run.run_dir))
        status = "done" if code == 0 and steps >= run.max_steps else "failed"
        write_marker(
            run.run_dir,
            {
                "status": status,
                "exit_code": code,
                "wall_s": seconds,
                "steps": steps,
                "max_steps": run.max_steps,
                "command": shlex.join(run.command()),
                "identity": run.identity(),
                "ended": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            },
        )
        say(f"{where}: {status} (exit {code}, {steps}/{run.max_steps} steps, {seconds:.0f} s)")


def subprocess_runner(command: Sequence[str], run_dir: Path, env: Mapping[str, str]) -> tuple[int, float]:
    """The real :data:`RunOne`: the command as a child process, its output appended to the run's
    log. On Ctrl-C the child is asked to stop after a checkpoint and given :data:`STOP_GRACE_S`
    to do so, then killed."""
    log = Path(run_dir) / LOG
    started = time.perf_counter()
    with log.open("a") as out:
        out.write(f"$ {shlex.join(command)}\n")
        out.flush()
        proc = subprocess.Popen(list(command), stdout=out, stderr=subprocess.STDOUT, env=dict(env))
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            # SIGTERM, not a second SIGINT: the trainer reads a second Ctrl-C as "stop without
            # saving"; SIGTERM asks for the same save-and-stop whether or not the SIGINT reached it.
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
    return code, time.perf_counter() - started
