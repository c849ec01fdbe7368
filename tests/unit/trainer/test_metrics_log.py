"""metrics.jsonl on resume: rows up to the resumed step stay, later ones (never saved) go."""

import json

from megatron_rl.trainer.metrics import MetricsLog


def _row(step):
    return {
        "step": step,
        "reward/mean": 0.5,
        "response_length/mean": 4.0,
        "throughput/tokens_per_s": 1.0,
        "timing/step_s": 1.0,
    }


def test_resume_keeps_saved_steps_and_appends(tmp_path):
    log = MetricsLog(tmp_path, enabled=True, total_steps=5)
    for step in (1, 2, 3):
        log.write(_row(step))
    log.close()
    log = MetricsLog(tmp_path, enabled=True, total_steps=5, resume_after=2)  # step 3 was not saved
    log.write(_row(3))
    log.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_fresh_run_starts_empty(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_row(7)) + "\n")
    log = MetricsLog(tmp_path, enabled=True, total_steps=1)
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_non_finite_values_are_written_as_null(tmp_path):
    log = MetricsLog(tmp_path, enabled=True, total_steps=1)
    log.write({**_row(1), "actor/grad_norm": float("nan")})
    log.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["actor/grad_norm"] is None


def test_the_progress_line_carries_the_latest_val_accuracy(tmp_path):
    log = MetricsLog(tmp_path, enabled=True, total_steps=3)
    start = {"step": 0, "val/held_out/accuracy": 0.1, "val/held_out/pass@4": 0.3, "timing/eval_s": 2.0}
    assert log.line(start) == "step    0/3  val 0.100 (starting weights)  eval 2.0s"
    assert log.line(_row(1)).endswith("1.0s  val 0.100")
    evaluated = {**_row(2), "val/held_out/accuracy": 0.25, "timing/eval_s": 1.5}
    assert log.line(evaluated).endswith("1.0s  val 0.250 (eval 1.5s)")
    log.close()
    assert MetricsLog(tmp_path, enabled=True, total_steps=3).line(_row(1)).endswith("1.0s")  # no eval, no val
