"""A training job under scripts/slurm/*.sbatch, submitted with `sbatch --wait` and watched from a test."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl import checkpoint

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 150
"""Default bound on a job, submission to end (Job(timeout_s=...) for longer ones)."""


class Job:
    """One `sbatch --wait` submission, watched from the test."""

    def __init__(
        self,
        env: dict,
        template: str,
        run_dir: Path,
        sbatch_args=(),
        extra_env=None,
        config: str = "smoke.yaml",
        overrides=(),
        timeout_s: float = JOB_TIMEOUT_S,
    ):
        self.run_dir = run_dir
        self.timeout_s = timeout_s
        self.log = run_dir.parent / f"{run_dir.name}.log"
        cmd = [
            "sbatch",
            "--wait",
            "--parsable",
            f"--output={self.log}",
            *sbatch_args,
            str(REPO / "scripts" / "slurm" / template),
            str(run_dir),
            str(REPO / "examples" / config),
            *overrides,
        ]
        # sbatch exports this environment to the job (--export=ALL).
        self.env = dict(env, MRL_PYTHON=sys.executable, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **(extra_env or {}))
        self.started = time.time()
        self.proc = subprocess.Popen(
            cmd, env=self.env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.job_id = self.proc.stdout.readline().strip().split(";")[0]
        assert self.job_id.isdigit(), f"sbatch did not print a job id: {self.job_id!r} {self.proc.stderr.read()}"

    def rows(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def wait_for(self, what: str, predicate, timeout_s: float = 90):
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(
                    f"job {self.job_id} ended (sbatch exit {self.proc.returncode}) before {what}:\n{self.text()}"
                )
            value = predicate()
            if value:
                return value
            time.sleep(0.2)
        self.cancel()
        pytest.fail(f"job {self.job_id}: no {what} after {timeout_s} s:\n{self.text()}")

    def finish(self) -> int:
        try:
            self.proc.wait(timeout=self.timeout_s - (time.time() - self.started))
        except subprocess.TimeoutExpired:
            self.cancel()
            pytest.fail(f"job {self.job_id} still running after {self.timeout_s} s:\n{self.text()}")
        self.seconds = time.time() - self.started
        return self.proc.returncode

    def cancel(self) -> None:
        subprocess.run(["scancel", self.job_id], env=self.env)
        self.proc.wait(timeout=60)

    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else "(no log)"

    def pids(self) -> list[int]:
        """Pids of this job's trainer ranks (the processes running `megatron_rl train`)."""
        out = subprocess.run(["scontrol", "listpids", self.job_id], env=self.env, capture_output=True, text=True).stdout
        pids = [int(line.split()[0]) for line in out.splitlines()[1:] if line.split() and line.split()[0].isdigit()]
        ranks = []
        for pid in pids:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            if Path(cmd[0].decode()).name.startswith("python") and cmd[1:4] == [b"-m", b"megatron_rl", b"train"]:
                ranks.append(pid)
        return ranks


def committed_step(run_dir: Path) -> int:
    return checkpoint.latest_step(run_dir / "checkpoints") or 0


def exit_status(run_dir: Path) -> dict:
    return json.loads((run_dir / "launch" / "exit_status.json").read_text())
