"""vLLM's routes per sample (rollout/routes.py): the experts its routers chose for every
input position equal HF transformers' router top-k on the same tokens, also across a
T-PPO continuation; vLLM's internal request ids map back to (request, sample index)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.rollout.routes import request_key

PROBE = Path(__file__).with_name("routes_probe.py")


def test_request_ids_map_to_request_and_sample_index():
    assert request_key("0_7-910f7a52") == ("7", 0)
    assert request_key("2_13-8ef8d6ac") == ("13", 2)
    assert request_key("13-8ef8d6ac") == ("13", 0)  # n = 1: no child prefix
    with pytest.raises(ValueError, match="unexpected vLLM request id"):
        request_key("13")


@pytest.mark.slow
def test_recorded_routes_equal_transformers_router(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(PROBE), str(tmp_path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for part in ("generated", "continued"):
        r = out[part]
        assert r["shapes_ok"] and r["missing"] == 0, (part, r)
        assert r["agreed"] == r["total"] > 0, (part, r)  # fp32: no near-ties on these tokens
    assert max(out["continued_lengths"]) > 3  # the continuation added a window
