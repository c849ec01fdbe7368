"""A run's exit code, chosen in one place (trainer.ending) from the launch contract."""

import math

from megatron_rl.launch import exit_codes
from megatron_rl.trainer.ending import exit_code, summary


def test_the_exit_code_of_each_way_a_run_ends():
    assert exit_code(10, 10, None, None) == exit_codes.DONE
    assert exit_code(4, 10, None, None) == exit_codes.STOPPED  # a stop signal: requeue me
    assert exit_code(4, 10, "2 steps in a row trained nothing", None) == exit_codes.CONFIG_ERROR
    # failed rollout ranks are requeued, whatever else happened
    assert exit_code(10, 10, "an error too", "rollout rank 1: RuntimeError") == exit_codes.FAILED


def test_the_summary_averages_five_finite_rewards_at_each_end(tmp_path):
    rewards = [0.1, math.nan, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]  # a T-PPO step with no finished response: nan
    history = [{"reward/mean": r} for r in rewards]
    evals = [{"step": 0, "val/held_out/accuracy": 0.1}, {"step": 8, "val/held_out/accuracy": 0.4}]
    out = summary(tmp_path, history, evals, 8, exit_codes.DONE, None)
    assert out["steps"] == 8 and out["last_step"] == 8 and out["exit_code"] == exit_codes.DONE
    assert math.isclose(out["first_reward"], (0.1 + 0.2 + 0.3 + 0.4 + 0.5) / 5)
    assert math.isclose(out["last_reward"], (0.3 + 0.4 + 0.5 + 0.6 + 0.7) / 5)
    assert out["val_accuracy"] == {"held_out": ((0, 0.1), (8, 0.4))}
