"""Conversion streams: loading a ~260 MB model from HF and saving it back each need only
a small fraction of the model's size on top of the model itself."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("memory_probe.py")
ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")


def run(*args):
    proc = subprocess.run(
        [sys.executable, str(PROBE), *map(str, args)], env=ENV, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_load_and_save_peak_memory_is_a_small_fraction_of_the_model(tmp_path):
    run("make", tmp_path / "hf")
    numbers = json.loads(run("convert", tmp_path / "hf").splitlines()[-1])
    print(numbers)
    model = numbers["model_mb"]
    assert model > 200
    # Streaming: at most a few of the largest tensors at once (16 MB here), never the model.
    assert numbers["load_hf"]["extra_peak_mb"] < 0.25 * model, numbers
    assert numbers["save_hf"]["extra_peak_mb"] < 0.25 * model, numbers
