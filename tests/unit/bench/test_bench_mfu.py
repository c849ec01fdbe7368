"""The MFU benchmark: argument checks, layout sweep, GPU peak table, and one real short run."""

import json
import math
import subprocess
import sys

import pytest

from megatron_rl_lab.bench.args import BenchArgumentError
from megatron_rl_lab.bench.cli import build_parser
from megatron_rl_lab.bench.hardware import gpu_peak_tflops
from megatron_rl_lab.bench.plan import make_plan, sweep_layouts
from megatron_rl_lab.testing.tiny import TINY_DENSE, TINY_MOE


def _plan(*argv, world=1):
    return make_plan(build_parser().parse_args(["mfu", "--seq-length", "32", *argv]), world)


def test_sweep_layouts_fit_world_and_model():
    def names(arch, world):
        return sorted((p.tp, p.pp, p.ep) for p in sweep_layouts(arch, world))

    # World 2: pure DP, TP2, PP2 for both; EP2 only where there are experts.
    assert names(TINY_DENSE, 2) == [(1, 1, 1), (1, 2, 1), (2, 1, 1)]
    assert names(TINY_MOE, 2) == [(1, 1, 1), (1, 1, 2), (1, 2, 1), (2, 1, 1)]
    # World 8, dense: TP8 does not divide 4 heads, PP8 does not divide 4 layers.
    assert (8, 1, 1) not in names(TINY_DENSE, 8) and (1, 8, 1) not in names(TINY_DENSE, 8)


def test_plan_rejects_what_cannot_run():
    with pytest.raises(BenchArgumentError, match="neither a preset.*cpu-dense-5m"):
        _plan("--model", "no-such-model")
    with pytest.raises(BenchArgumentError, match="--seq-length 256 exceeds .* 128"):
        _plan("--model", "tiny-dense-4l", "--seq-length", "256")
    with pytest.raises(BenchArgumentError, match="not divisible by tensor_model_parallel_size"):
        _plan("--model", "tiny-dense-4l", "--tp", "2", world=1)
    with pytest.raises(BenchArgumentError, match="global batch 6 .* micro_batch_size x data-parallel size = 4x1"):
        _plan("--model", "tiny-dense-4l", "--global-batch-size", "6", "--micro-batch-size", "4")
    # A sweep keeps only the micro-batch sizes that split the batch (8 sequences over DP2).
    _, _, cases, _ = _plan("--model", "tiny-moe-4l", "--sweep", "--sweep-micro-batch-sizes", "1,3,4", world=2)
    assert {(c.parallel.dp(2), c.micro_batch_size) for c in cases} == {(2, 1), (2, 4), (1, 1), (1, 4)}


def test_gpu_peak_table():
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0  # SXM
    assert gpu_peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert gpu_peak_tflops("NVIDIA H200", "bf16") == 989.0
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == 156.0  # TF32 tensor cores
    assert gpu_peak_tflops("Tesla T4", "bf16") is None


@pytest.mark.slow
def test_bench_script_short_run(tmp_path):
    out = tmp_path / "mfu.json"
    proc = subprocess.run(
        [
            sys.executable,
            "tools/bench_mfu.py",
            "--model",
            "tiny-dense-4l",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--seq-length",
            "32",
            "--global-batch-size",
            "2",
            "--peak-matmul-size",
            "256",
            "--profile",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    (case,) = report["cases"]
    assert report["world_size"] == 1 and report["peak"]["tflops"] > 0
    assert case["tokens_per_step"] == 2 * 32 and len(case["step_times_s"]) == 2
    # Tiny dense at s=32 (hidden 64, 4 layers, q 128, kv 64, ffn 128, vocab 96), MACs per token:
    # 4 * (24576 attention projections + 24576 MLP + 128*32 core attention) + 64*96 head
    # = 219136, x 6 for forward + backward.
    assert case["flops_per_token"] == 6 * 219136
    assert case["achieved_tflops_per_device"] * 1e12 == pytest.approx(case["tokens_per_s"] * 6 * 219136)
    assert case["mfu"] == pytest.approx(case["achieved_tflops_per_device"] / report["peak"]["tflops"])
    assert case["peak_memory_gib"] > 0.05  # RSS of a process holding torch and Megatron
    assert math.isfinite(case["last_loss"]) and abs(case["last_loss"] - math.log(96)) < 0.5
    assert "tokens/s" in proc.stdout and "MFU" in proc.stdout
    # The profiled step: the CPU's SDPA kernel is the attention, the projections are GEMMs, and
    # the categories add up to the busy time, which one step's wall time bounds.
    profile = case["profile"]
    shares = {label: c["seconds"] for label, c in profile["categories"].items()}
    assert shares["attention"] > 0 and shares["gemm"] > 0 and shares["optimizer"] > 0, shares
    assert sum(shares.values()) == pytest.approx(profile["busy_s"])
    assert 0 < profile["busy_s"] <= profile["step_wall_s"] * 1.05 and profile["idle_s"] is None
    assert any("scaled_dot_product" in op for op in profile["categories"]["attention"]["ops"]), profile["categories"]
    assert "profile: busy" in proc.stdout
