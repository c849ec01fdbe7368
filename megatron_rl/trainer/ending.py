"""How an RL run ends: its exit code and its summary, decided in one place.

The codes are the launch contract (:mod:`megatron_rl.launch.exit_codes`): done, stopped
early (requeue me), an error the trainer found and stopped on itself (a requeue would
only repeat it), or failed rollout ranks (requeued). ``RLTrainer.close`` writes the code
into the run's status file and returns the summary.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from megatron_rl.launch import exit_codes


def exit_code(last_step: int, max_steps: int, error: Optional[str], rollout_error: Optional[str]) -> int:
    """The code a training rank ends with (launch.exit_codes): failed rollout ranks first
    (requeued), then an error the trainer stopped on itself (not requeued: it would repeat),
    then finished or stopped early."""
    if rollout_error is not None:
        return exit_codes.FAILED
    if error is not None:
        return exit_codes.CONFIG_ERROR
    return exit_codes.DONE if last_step >= max_steps else exit_codes.STOPPED


def summary(
    run_dir: Path, history: list[dict], eval_history: list[dict], last_step: int, code: int, error: Optional[str]
) -> dict:
    """What ``train`` returns: the run's place and end, its reward's first and last five
    steps, and the first and last held-out accuracy of every eval set."""
    out = {"run_dir": str(run_dir), "steps": len(history), "last_step": last_step, "exit_code": code, "error": error}
    # T-PPO steps in which no response finished have no reward (nan).
    rewards = [r["reward/mean"] for r in history if math.isfinite(r["reward/mean"])]
    if rewards:
        first, last = rewards[:5], rewards[-5:]
        out.update(first_reward=sum(first) / len(first), last_reward=sum(last) / len(last))
    if eval_history:
        first, last = eval_history[0], eval_history[-1]
        out["val_accuracy"] = {  # set -> (step, accuracy) of the run's first and last evaluation
            key.split("/")[1]: ((first["step"], first[key]), (last["step"], last[key]))
            for key in first
            if key.startswith("val/") and key.endswith("/accuracy")
        }
    return out
