"""The fast in-place weight load (CPU) serves exactly what vLLM's own reload_weights
serves, also when buckets split decoder layers between modules."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("inplace_load_probe.py")


def _probe(work: Path, cpu_linear: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(PROBE), str(work), cpu_linear], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    work = tmp_path_factory.mktemp("inplace")
    return {kind: _probe(work, kind) for kind in ("packed", "plain")}


@pytest.mark.slow
@pytest.mark.parametrize("cpu_linear", ["packed", "plain"])
def test_inplace_load_serves_what_vllm_reload_serves(probes, cpu_linear):
    out = probes[cpu_linear]
    for step in out["steps"]:
        assert step["paths"] == ["inplace", "inplace", "reload", "reload"], step
        assert step["moved"] > 1e-2, step  # the new weights changed the served model
        assert step["fast_vs_reload"] == 0.0, step  # bitwise the same kernels and weights
    assert out["half_vs_full"] > 1e-2, out  # the first half alone served a mix
    assert out["split_vs_reload"] == 0.0, out


@pytest.mark.slow
def test_plain_linear_weights_serve_the_packed_model(probes):
    """cpu_linear=plain: every layer that vLLM packs for oneDNN by default (linear layers, the
    router, the LM head) keeps its plain weight instead, also after vLLM's own reload, and
    serves the logprobs of the packed weights."""
    gemms = probes["packed"]["gemm_layers"]
    assert gemms >= 5 and probes["packed"]["plain_linear_layers"] == 0
    assert probes["plain"]["plain_linear_layers"] == probes["plain"]["plain_linear_layers_after_reload"] == gemms
    diff = max(abs(a - b) for ra, rb in zip(probes["packed"]["initial"], probes["plain"]["initial"]) for a, b in zip(ra, rb))
    assert diff < 1e-5
