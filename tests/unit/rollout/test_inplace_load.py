"""The fast in-place weight load (CPU) serves exactly what vLLM's own reload_weights
serves, also when buckets split decoder layers between modules."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("inplace_load_probe.py")


@pytest.mark.slow
def test_inplace_load_serves_what_vllm_reload_serves(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(PROBE), str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for step in out["steps"]:
        assert step["paths"] == ["inplace", "inplace", "reload", "reload"], step
        assert step["moved"] > 1e-2, step  # the new weights changed the served model
        assert step["fast_vs_reload"] == 0.0, step  # bitwise the same kernels and weights
    assert out["half_vs_full"] > 1e-2, out  # the first half alone served a mix
    assert out["split_vs_reload"] == 0.0, out
