"""The embedded default (`make train`: DAPO on the digit task, tiny MoE, world 1) learns.

25 of its 40 steps: the mean reward of steps 21-25 must clear the bar of a policy that
ignores the prompt and always answers the most frequent digit (0.324), from a start near
chance (0.1). The reference run (examples/reference/dapo_reward_curve.json) has 0.14 over
steps 1-5 and 0.41 over steps 21-25 (43 s on the 2-core machine).
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

MAJORITY_ANSWER_REWARD = 0.324
STEPS = 25


def test_make_train_reward_rises_above_the_majority_answer(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "megatron_rl",
        "train",
        "--config",
        "examples/dapo.yaml",
        f"trainer.max_steps={STEPS}",
        f"trainer.run_dir={tmp_path / 'run'}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rewards = [
        json.loads(line)["reward/mean"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(rewards) == STEPS
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.25 and last > MAJORITY_ANSWER_REWARD, (first, last, rewards)
