"""`megatron-rl eval`'s inputs, checked before any model is built: one line and exit 2 for a
bad path, set, option or override; which --ckpt paths name which step; the table.

The evaluation itself (a checkpoint reproducing its run's val numbers) is tested on the
embedded default's run in tests/distributed/test_embedded_default.py."""

import pytest

from megatron_rl.cli import main as cli_main
from megatron_rl.evaluation.cli import EvalInputError, checkpoint_step, format_table, records_path, select_sets

CONFIG = "examples/dapo.yaml"


def _committed(root, *steps):
    for step in steps:
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / "COMMIT").write_text("{}")
    return root


def _one_error_line(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:  # argparse's own errors exit
        code = cli_main(["eval", *argv])
        raise SystemExit(code)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    return err


def test_bad_options_paths_and_sets_are_one_line_and_exit_2(tmp_path, capsys):
    _committed(tmp_path / "run" / "checkpoints", 5)
    assert "one of the arguments --ckpt --hf is required" in _one_error_line(capsys, "--config", CONFIG)
    err = _one_error_line(capsys, "--config", CONFIG, "--ckpt", str(tmp_path), "--hf", str(tmp_path))
    assert "not allowed with" in err
    assert "unrecognized arguments: --bogus" in _one_error_line(capsys, "--config", CONFIG, "--bogus", "--hf", "x")
    err = _one_error_line(capsys, "--config", CONFIG, "--ckpt", str(tmp_path / "missing"))
    assert "--ckpt" in err and "does not exist" in err
    err = _one_error_line(capsys, "--config", CONFIG, "--ckpt", str(tmp_path / "run" / "checkpoints"), "--step", "7")
    assert "step 7 is not a committed checkpoint" in err and "[5]" in err
    err = _one_error_line(capsys, "--config", CONFIG, "--hf", str(tmp_path / "run"))
    assert "--hf" in err and "no config.json" in err
    err = _one_error_line(capsys, "--config", CONFIG, "--hf", str(tmp_path), "--sets", "held_out,aime")
    assert "unknown eval set 'aime'; configured: held_out" in err
    err = _one_error_line(capsys, "--config", CONFIG, "eval.sets={}", "--hf", str(tmp_path))
    assert "names no eval set" in err
    err = _one_error_line(capsys, "--config", CONFIG, "eval.n_sample=3", "--hf", str(tmp_path))
    assert "config error" in err and "n_sample" in err
    err = _one_error_line(capsys, "--config", CONFIG, "--hf", str(tmp_path), "--step", "3")
    assert "--step applies to --ckpt" in err


def test_ckpt_takes_a_run_dir_a_root_or_a_step_dir(tmp_path):
    root = _committed(tmp_path / "run" / "checkpoints", 10, 20)
    (root / ".tmp_step_30").mkdir()  # an unfinished save is not a step
    assert checkpoint_step(tmp_path / "run", None) == (root, 20)
    assert checkpoint_step(root, None) == (root, 20)
    assert checkpoint_step(root, 10) == (root, 10)
    assert checkpoint_step(root / "step_10", None) == (root, 10)
    with pytest.raises(EvalInputError, match="--step 20 names another step"):
        checkpoint_step(root / "step_10", 20)
    (root / "step_40").mkdir()  # no COMMIT marker
    with pytest.raises(EvalInputError, match="step 40 is not a committed checkpoint"):
        checkpoint_step(root / "step_40", None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(EvalInputError, match="not a checkpoint: no committed step"):
        checkpoint_step(tmp_path / "empty", None)


def test_sets_are_selected_in_the_order_named():
    configured = {"a": 1, "b": 2, "c": 3}
    assert select_sets(configured, None) == configured
    assert list(select_sets(configured, "c, a")) == ["c", "a"]
    with pytest.raises(EvalInputError, match="configured: a, b, c"):
        select_sets(configured, ",")


def test_the_table_has_a_row_per_set_and_a_column_per_k(tmp_path):
    metrics = {
        "val/held_out/accuracy": 0.625,
        "val/held_out/pass@1": 0.625,
        "val/held_out/pass@4": 0.875,
        "val/held_out/response_length": 3.5,
        "val/held_out/truncated": 0.0,
    }
    lines = format_table(metrics, {"held_out": (128, 512)}, [1, 4]).splitlines()
    assert lines[0].split() == ["set", "prompts", "samples", "accuracy", "pass@1", "pass@4", "length", "truncated"]
    assert lines[1].split() == ["held_out", "128", "512", "0.6250", "0.6250", "0.8750", "3.50", "0.0000"]
    assert records_path(tmp_path / "val.json") == tmp_path / "val.prompts.jsonl"
