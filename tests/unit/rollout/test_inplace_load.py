"""The fast in-place weight load (CPU) serves exactly what vLLM's own reload_weights
serves, also when buckets split decoder layers between modules, in fp32 and bf16; the
weight check reads back exactly what either path loaded and names what differs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("inplace_load_probe.py")


def _probe(work: Path, cpu_linear: str, dtype: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(PROBE), str(work), cpu_linear, dtype], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    work = tmp_path_factory.mktemp("inplace")
    return {kind: _probe(work, *kind.split("-")) for kind in KINDS}


KINDS = ("packed-float32", "plain-float32", "packed-bfloat16")
"""bf16 on a CPU without AVX512-BF16 keeps plain linear weights (vLLM's torch fallback)."""


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_inplace_load_serves_what_vllm_reload_serves(probes, kind):
    out = probes[kind]
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
    packed, plain = probes["packed-float32"], probes["plain-float32"]
    gemms = packed["gemm_layers"]
    assert gemms >= 5 and packed["plain_linear_layers"] == 0
    assert plain["plain_linear_layers"] == plain["plain_linear_layers_after_reload"] == gemms
    diff = max(abs(a - b) for ra, rb in zip(packed["initial"], plain["initial"]) for a, b in zip(ra, rb))
    assert diff < 1e-5


TINY_MOE_ELEMENTS = {"packed-float32": 223_040, "plain-float32": 214_848, "packed-bfloat16": 223_040}
"""Elements the check reads for the tiny MoE, counted by hand from TINY_QWEN3_MOE: per
layer qkv 256x64 + o_proj 64x128 + q/k norms 2x32 + two norms 2x64 + router 4x64 + experts
4x64x64 + 4x64x32 = 49,600, four layers 198,400; embedding and LM head 128x64 each (vLLM
pads the vocabulary of 96 to 128) + final norm 64; the LM head a second time through its
GEMM handle unless it is plain (8,192)."""


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_weight_check_reads_back_every_kind_of_layer(probes, kind):
    """After the in-place load and after vLLM's own reload the check finds every weight equal
    to the bucket; against a bucket differing in one expert element, a norm, the q rows of
    the fused qkv and the embedding it names exactly those parameters."""
    out = probes[kind]
    for step in out["steps"]:
        assert step["checked"] == [TINY_MOE_ELEMENTS[kind]] * 2, step
        assert step["check_problems"] == [], step
    wrong = out["wrong"]
    assert set(wrong) == {
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.1.mlp.experts.routed_experts.w2_weight",
    }
    assert wrong["model.layers.1.mlp.experts.routed_experts.w2_weight"][0] == 1  # the one element
    assert wrong["model.layers.0.input_layernorm.weight"][0] > 0
    assert 0 < wrong["model.layers.0.self_attn.qkv_proj.weight"][0] <= 128 * 64  # only q's rows
    assert out["wrong_unsupported"] == []
