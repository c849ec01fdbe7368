"""The model smoke job (`trainer.job=smoke`, examples/smoke.yaml) learns its task (single rank, CPU)."""

import json
import math
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_smoke_job_learns_counting(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rl",
            "train",
            "--config",
            "examples/smoke.yaml",
            f"trainer.run_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))
    chance = math.log(96)  # tiny vocab: a model that has learned nothing sits at ln(96)
    assert abs(rows[0]["lm_loss"] - chance) < 0.3
    assert rows[-1]["lm_loss"] < 1.0, rows[-1]
    assert (tmp_path / "config.yaml").exists()
