"""The benchmarks' model presets: the runtime's one table (megatron_rl.models.presets).

``bench mfu --model``, ``bench weight-sync --preset``, ``bench checkpoint --model``,
``bench mismatch --model`` and tools/bench_rollout_speed.py all read it, so a number in
docs/benchmarks.md names exactly one model whichever bench produced it, the same model a
recipe or a test of that name builds. The benches take the qwen3 / qwen3_moe presets: the
families :func:`megatron_rl_lab.testing.hf_models.save_tiny_model` writes, so every bench
(the weight sync and rollout benches write the model as an HF directory) takes every one.

The table "Model presets" in docs/benchmarks.md gives each one's size and the numbers it
produced; tests/unit/bench/test_presets.py checks that table against the runtime's.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

from megatron_rl.models.hf_config import ModelArch, arch_from_hf
from megatron_rl.models.presets import PRESETS as MODEL_PRESETS

BENCH_FAMILIES = ("qwen3", "qwen3_moe")
"""The families :func:`megatron_rl_lab.testing.hf_models.save_tiny_model` writes."""

PRESETS: dict[str, ModelArch] = {name: arch for name, arch in MODEL_PRESETS.items() if arch.family in BENCH_FAMILIES}


def resolve_model(name_or_path: str) -> ModelArch:
    """A preset name, or an HF model directory / config.json (read without transformers)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        raise ValueError(
            f"model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor an HF model directory / config.json"
        )
    return arch_from_hf(types.SimpleNamespace(**json.loads(config.read_text())))


def model_label(name_or_path: str) -> str:
    """A short name for file names: the preset, or the model directory's name."""
    if name_or_path in PRESETS:
        return name_or_path
    path = Path(name_or_path)
    return (path if path.is_dir() else path.parent).name or "model"
