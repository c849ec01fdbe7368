"""Steps that keep no trainable group: a warning line each, and the run stops (exit 2)
after algorithm.max_empty_steps of them in a row; a step that trains resets the count."""

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.algorithms.recipes import get_recipe
from megatron_rl.config import ConfigError, load_config
from megatron_rl.launch import exit_codes
from megatron_rl.trainer.empty_steps import EmptyStepGuard
from megatron_rl.trainer.trainer import RLTrainer


def test_warns_on_each_empty_step_and_stops_at_the_limit():
    guard = EmptyStepGuard(limit=3)
    assert guard.observe(1, trained_rows=16) == (None, None)
    lines = [guard.observe(step, trained_rows=0) for step in (2, 3)]
    for step, (warning, stop) in zip((2, 3), lines):
        assert stop is None and warning.startswith(f"warning: step {step} kept no trainable group")
        assert "\n" not in warning and "algorithm.max_empty_steps=3" in warning
    assert "1 such step(s) in a row" in lines[0][0] and "2 such step(s) in a row" in lines[1][0]
    warning, stop = guard.observe(4, trained_rows=0)
    assert warning is None and "\n" not in stop
    assert stop.startswith("3 steps in a row (the last: step 4) kept no trainable group")
    assert "algorithm.max_empty_steps=3" in stop


def test_a_step_that_trains_resets_the_count():
    guard = EmptyStepGuard(limit=2)
    assert guard.observe(1, 0)[1] is None
    assert guard.observe(2, 8) == (None, None) and guard.in_a_row == 0
    assert guard.observe(3, 0)[1] is None  # one in a row again, not two
    assert guard.observe(4, 0)[1] is not None


def test_a_limit_of_one_stops_at_the_first_empty_step():
    assert EmptyStepGuard(limit=1).observe(7, 0)[1].startswith("1 steps in a row (the last: step 7)")
    with pytest.raises(ValueError, match="limit=0 must be >= 1"):
        EmptyStepGuard(limit=0)


def test_max_empty_steps_is_validated():
    assert load_config(None, []).algorithm.max_empty_steps == 5
    assert load_config(None, ["algorithm.max_empty_steps=2"]).algorithm.max_empty_steps == 2
    with pytest.raises(ConfigError, match="algorithm.max_empty_steps=0 must be >= 1"):
        load_config(None, ["algorithm.max_empty_steps=0"])
    with pytest.raises(ConfigError, match="algorithm.max_empty_steps='many' is not a valid int"):
        load_config(None, ["algorithm.max_empty_steps=many"])


def test_the_trainer_warns_then_stops(capsys):
    """RLTrainer.count_empty on a stand-in holding only what it reads (building a trainer
    takes vLLM and Megatron): rank 0 prints each warning; the limit sets the error and stops."""
    from megatron_rl.trainer.trainer import RLTrainer

    trainer = SimpleNamespace(empty_steps=EmptyStepGuard(limit=2), rank=0, error=None)
    assert RLTrainer.count_empty(trainer, 5, 0) is False and trainer.error is None
    assert capsys.readouterr().err.startswith("warning: step 5 kept no trainable group")
    assert RLTrainer.count_empty(trainer, 6, 0) is True and trainer.error.startswith("2 steps in a row")
    assert capsys.readouterr().err == ""  # the stop line is the CLI's to print, once


def test_the_cli_prints_the_stop_in_one_line_and_exits_2(monkeypatch, capsys, tmp_path):
    import megatron_rl.trainer as trainer_pkg
    from megatron_rl import cli

    summary = {
        "run_dir": str(tmp_path),
        "steps": 3,
        "last_step": 3,
        "exit_code": exit_codes.CONFIG_ERROR,
        "error": "3 steps in a row (the last: step 3) kept no trainable group",
    }
    monkeypatch.setattr(trainer_pkg, "train", lambda cfg: summary)
    assert cli.main(["train", f"trainer.run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err == "megatron-rl: error: 3 steps in a row (the last: step 3) kept no trainable group\n"


def _signal(advantages, loss_mask, recipe="grpo", critic=None, **overrides):
    fake = SimpleNamespace(recipe=get_recipe(recipe, **overrides), critic=critic)
    batch = SimpleNamespace(advantages=torch.tensor(advantages), loss_mask=torch.tensor(loss_mask))
    return RLTrainer.has_learning_signal(fake, batch)


def test_a_step_whose_every_loss_token_has_advantage_zero_has_no_signal():
    mask = [[False, True, True], [False, True, False]]
    assert not _signal([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], mask)
    assert not _signal([[0.7, 0.0, 0.0], [0.0, 0.0, -0.3]], mask)  # nonzero only outside the loss
    assert _signal([[0.0, 0.0, 0.0], [0.0, 1e-6, 0.0]], mask)
    # A KL term or a critic still has a gradient to follow when the advantages are 0.
    assert _signal([[0.0] * 3] * 2, mask, kl={"kind": "k3", "coef": 0.001})
    assert _signal([[0.0] * 3] * 2, mask, recipe="ppo", critic=object())
