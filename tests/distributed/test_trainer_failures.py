"""The trainer's launch when a rollout rank fails, and at a terminal, under torchrun/gloo:
rollout ranks slower to start than their bound, killed, or hung (world 2: one training rank,
one rollout rank) end the launch naming the rank, the committed checkpoints intact; Ctrl-C
(world 1) finishes the step, saves it, and the same run dir resumes."""

import json
import os
import sys
import time
from pathlib import Path

import pytest

from megatron_rl_lab.testing.torchrun import _free_port, descendants, kill_tree, run_process_group
from tests.distributed.trainer_runs import tiny_run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _launch_rank_pids(launcher: int, rank: int) -> list[int]:
    """Processes below a launch started as launch rank ``rank`` (torchrun's RANK)."""
    found = []
    for pid in descendants(launcher):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if f"RANK={rank}".encode() in environ:
            found.append(pid)
    return found


def _disaggregated_grpo(run_dir, base, *overrides) -> list[str]:
    """The torchrun command of a world-2 GRPO run with its vLLM on rank 1 (one training rank,
    one rollout rank), for the rollout-rank failure tests."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={_free_port()}",
        "-m",
        "megatron_rl",
        "train",
        "--config",
        "examples/grpo.yaml",
        *tiny_run(run_dir, base),
        "rollout.placement=disaggregated",
        "rollout.num_ranks=1",
        *overrides,
    ]


def _wait_for_step_2(proc, metrics: Path, timeout_s: float, poll_s: float) -> None:
    """Until ``metrics`` holds step 2's row; fails if the run ends or stalls before it."""
    deadline = time.monotonic() + timeout_s
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 2"
        time.sleep(poll_s)


def _signal_rollout_rank_after_step_2(tmp_path, base, signum, *overrides):
    """A disaggregated GRPO run (world 2, a checkpoint every step) whose rollout rank gets
    ``signum`` once step 2 is logged: (exit code, output, seconds from the signal to the
    end, steps logged, newest intact checkpoint)."""
    import subprocess

    from megatron_rl.checkpoint.recovery import newest_intact_step

    run_dir = tmp_path / "run"
    cmd = _disaggregated_grpo(run_dir, base, "trainer.max_steps=200", "checkpoint.save_interval=1", *overrides)
    proc = subprocess.Popen(
        cmd,
        env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        _wait_for_step_2(proc, metrics, timeout_s=900, poll_s=0.5)
        rollout = _launch_rank_pids(proc.pid, rank=1)
        assert len(rollout) == 1, rollout
        os.kill(rollout[0], signum)
        signalled = time.monotonic()
        out, _ = proc.communicate(timeout=300)
        ended_after = time.monotonic() - signalled
    finally:
        kill_tree(proc.pid)
    logged = len(metrics.read_text().splitlines())
    return proc.returncode, out, ended_after, logged, newest_intact_step([run_dir / "checkpoints"], "fail")


def test_rollout_engines_slower_to_start_than_the_start_timeout_end_the_launch_naming_it(tmp_path, bases):
    """rollout.start_timeout_s bounds the wait for the rollout ranks' engines (command 0) on
    its own: at 1 s (a vLLM start takes several) the launch ends with one error line naming
    the rollout rank and that setting, exit 1, before any step."""
    run_dir = tmp_path / "run"
    cmd = _disaggregated_grpo(run_dir, bases["qwen3"], "rollout.start_timeout_s=1")
    proc = run_process_group(cmd, dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"), timeout_s=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    line = next((x for x in out.splitlines() if x.startswith("megatron-rl: error:")), out[-3000:])
    assert line == (
        "megatron-rl: error: rollout rank 1 of the launch did not answer command 0 within "
        "rollout.start_timeout_s=1 s: hung, or slower than that; nothing was trained"
    ), line
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text()


def test_a_killed_rollout_rank_ends_the_launch_and_the_checkpoints_stay(tmp_path, bases):
    """SIGKILL of the rollout rank after step 2: the launch ends at once with a requeue-able
    exit code and the rollout rank named, and the checkpoints committed before stay intact (a
    requeue resumes from the newest). Who names it is a race: the trainer (its bridge
    breaks) or torchrun (it saw the rank die first and ended the others)."""
    import re
    import signal

    code, out, ended_after, logged, intact = _signal_rollout_rank_after_step_2(tmp_path, bases["qwen3"], signal.SIGKILL)
    assert code not in (0, 2, 75), out[-3000:]  # a failure the Slurm script may requeue
    by_trainer = "megatron-rl: error: rollout rank 1 of the launch " in out  # its bridge broke on a send or receive
    by_torchrun = re.search(r"Root Cause.*?rank\s*: 1 \(local_rank: 1\)\s*exitcode\s*: -9", out, re.S)
    assert by_trainer or by_torchrun, out[-3000:]
    assert ended_after < 120, ended_after
    assert intact is not None and 2 <= intact <= logged, (intact, logged)


def test_a_hung_rollout_rank_ends_the_run_with_its_name_within_the_timeout(tmp_path, bases):
    """SIGSTOP of the rollout rank after step 2 (alive, answering nothing): the training ranks
    stop after rollout.timeout_s with one error line naming the rollout rank, exit 1 (which
    the Slurm script requeues), the checkpoints committed before intact. The engine's start
    (command 0, over 15 s on a loaded 2-core machine) has its own bound,
    rollout.start_timeout_s (default an hour), so 15 s only has to cover a step's batch."""
    import signal

    code, out, ended_after, logged, intact = _signal_rollout_rank_after_step_2(
        tmp_path, bases["qwen3"], signal.SIGSTOP, "rollout.timeout_s=15"
    )
    assert code == 1, out[-3000:]
    line = next((x for x in out.splitlines() if x.startswith("megatron-rl: error:")), out[-3000:])
    assert (
        line.startswith("megatron-rl: error: rollout rank 1 of the launch did not") and "rollout.timeout_s=15 s" in line
    ), line
    assert 15 <= ended_after < 120, ended_after
    assert intact is not None and 2 <= intact <= logged, (intact, logged)


def _world1_dapo(run_dir, base, steps: int) -> list[str]:
    """`megatron-rl train` alone (world 1, no torchrun): how a person runs it at a terminal."""
    return [
        sys.executable,
        "-m",
        "megatron_rl",
        "train",
        "--config",
        "examples/dapo.yaml",
        *tiny_run(run_dir, base),
        f"trainer.max_steps={steps}",
        "eval.sets={}",  # the recipe's held-out split is a task's; this run reads a prompt file
    ]


def test_ctrl_c_finishes_the_step_saves_it_and_the_same_run_dir_resumes(tmp_path, bases):
    """Ctrl-C at a terminal reaches the whole foreground process group: SIGINT to the group
    once step 2 is logged. The step in progress finishes, its checkpoint is committed, one
    line says so and how to go on, exit 75 (stopped after a checkpoint) without a
    traceback; a rerun on the same run dir resumes after that step."""
    import signal
    import subprocess

    from megatron_rl.checkpoint.recovery import newest_intact_step

    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(
        _world1_dapo(run_dir, bases["qwen3"], 50),
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        _wait_for_step_2(proc, metrics, timeout_s=600, poll_s=0.2)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        kill_tree(proc.pid)
    stopped_at = len(metrics.read_text().splitlines())
    assert proc.returncode == 75, (out + err)[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert f"stopped on SIGINT after step {stopped_at} (Ctrl-C); checkpoint saved in " in out, out[-2000:]
    assert newest_intact_step([run_dir / "checkpoints"], "fail") == stopped_at
    resumed, out = _train_world1(run_dir, bases["qwen3"], stopped_at + 1, env)
    assert "resumed from" in out and [r["step"] for r in resumed] == list(range(1, stopped_at + 2)), out[-2000:]


def _train_world1(run_dir, base, steps, env):
    proc = run_process_group(_world1_dapo(run_dir, base, steps), env, timeout_s=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()], proc.stdout
