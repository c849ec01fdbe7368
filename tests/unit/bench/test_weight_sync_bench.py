"""The weight-sync benchmark: its layout arguments, and one real run under torchrun (world 2).

The run syncs a tiny qwen3 model from Megatron TP2 into vLLM once; the bytes it reports
must equal the HF checkpoint's tensor bytes (read from the safetensors headers, not from
the benchmark), and every time, rate and memory figure must be present and positive.
"""

import argparse
import json
from pathlib import Path

import pytest

from megatron_rl_lab.bench import weight_sync
from megatron_rl_lab.bench.args import BenchArgumentError
from megatron_rl_lab.testing.torchrun import run_script

ROOT = Path(__file__).resolve().parents[3]


def _args(*argv: str) -> argparse.Namespace:
    return weight_sync.add_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def test_layouts_that_do_not_fit_are_skipped_and_bad_names_rejected():
    plan = weight_sync.make_plan(_args("--preset", "cpu-moe-14m", "--layouts", "tp2,pp4,tp2_ep2_etp1"), world=2)
    assert [name for name, _ in plan.layouts] == ["tp2", "tp2_ep2_etp1"]
    assert plan.layouts[1][1].etp == 1 and plan.layouts[1][1].ep == 2
    assert len(plan.skipped) == 1 and plan.skipped[0].startswith("pp4:")
    with pytest.raises(BenchArgumentError, match="'xp2' is not <kind><size>"):
        weight_sync.make_plan(_args("--layouts", "tp2_xp2"), world=2)
    with pytest.raises(BenchArgumentError, match="none of --layouts ep2 fits"):
        weight_sync.make_plan(_args("--preset", "cpu-dense-9m", "--layouts", "ep2"), world=2)
    with pytest.raises(BenchArgumentError, match="--vllm-tp 4 must divide the world size 2"):
        weight_sync.make_plan(_args("--vllm-tp", "4", "--layouts", "tp2"), world=2)
    with pytest.raises(BenchArgumentError, match="--lora-rank needs a dense model"):
        weight_sync.make_plan(_args("--preset", "cpu-moe-14m", "--lora-rank", "8"), world=2)
    lora = weight_sync.make_plan(_args("--layouts", "tp2", "--lora-rank", "8", "--lora-sync", "adapter"), world=2)
    assert (lora.lora_rank, lora.lora_sync) == (8, "adapter")


def _checkpoint_bytes(hf_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in hf_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                numel = 1
                for n in piece.get_shape():
                    numel *= n
                total += numel * {"F32": 4, "BF16": 2, "F16": 2}[piece.get_dtype()]
    return total


@pytest.mark.slow
@pytest.mark.distributed
def test_benchmark_reports_the_model_bytes_and_positive_figures(tmp_path):
    from megatron_rl_lab.testing.hf_models import save_tiny_model
    from megatron_rl_lab.testing.tiny import TINY_DENSE

    hf_dir = save_tiny_model(TINY_DENSE, tmp_path / "hf")
    out = tmp_path / "result.json"
    proc = run_script(
        ROOT / "tools" / "bench_weight_sync.py",
        2,
        [
            "--hf",
            str(hf_dir),
            "--layouts",
            "tp2",
            "--bucket-mb",
            "1",
            "--iterations",
            "1",
            "--warmup",
            "0",
            "--copy-repeats",
            "1",
            "--work-dir",
            str(tmp_path / "work"),
            "--json",
            str(out),
        ],
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["model"]["family"] == "qwen3"
    (row,) = result["results"]
    assert row["layout"] == "tp2" and row["buckets"] == 1
    assert row["bytes"] == _checkpoint_bytes(hf_dir)
    for key in (
        "sync_s",
        "gb_per_s",
        "gather_s",
        "load_s",
        "copy_s",
        "copy_all_ranks_s",
        "ratio_to_copy",
        "sync_cpu_s",
        "peak_extra_mb",
        "gather_received_mb_max_rank",
    ):
        assert row[key] > 0, (key, row)
    assert abs(row["gb_per_s"] - row["bytes"] / row["sync_s"] / 1e9) < 1e-9
    assert "sync s" in proc.stdout and "x copy" in proc.stdout  # the printed table
