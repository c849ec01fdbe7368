"""The benchmarks' presets: the runtime's one table, documented, and usable by every bench.

The sizes are recounted here from the architecture (not taken from the code under test) and
compared with the table in docs/benchmarks.md, so a documented number cannot silently point
at a different model than the one its name builds.
"""

import re
from pathlib import Path

import pytest

from megatron_rl.models.presets import PRESETS as MODEL_PRESETS
from megatron_rl.parallel.config import ParallelConfig
from megatron_rl_lab.bench.presets import PRESETS, resolve_model

ROOT = Path(__file__).resolve().parents[3]
_SUFFIX = {"M": 1e6, "B": 1e9}
_MIB = {"MiB": 2**20, "GiB": 2**30}


def _params(a) -> int:
    """Every weight but the norms: attention, MLP or experts + router, embedding and LM head."""
    q, kv = a.num_attention_heads * a.head_dim, a.num_query_groups * a.head_dim
    attention = 2 * a.hidden_size * q + 2 * a.hidden_size * kv
    if a.is_moe:
        mlp = a.num_moe_experts * (3 * a.hidden_size * a.moe_ffn_hidden_size + a.hidden_size)
        if a.moe_shared_expert_intermediate_size:
            mlp += 3 * a.hidden_size * a.moe_shared_expert_intermediate_size + a.hidden_size
    else:
        mlp = 3 * a.hidden_size * a.ffn_hidden_size
    return a.num_layers * (attention + mlp) + 2 * a.vocab_size * a.hidden_size


def _shape(a) -> str:
    ffn = (
        f"{a.num_moe_experts} experts top-{a.moe_router_topk} of {a.moe_ffn_hidden_size}"
        + (f" + shared {a.moe_shared_expert_intermediate_size}" if a.moe_shared_expert_intermediate_size else "")
        if a.is_moe
        else str(a.ffn_hidden_size)
    )
    return (
        f"{a.hidden_size} × {a.num_layers}, {a.num_attention_heads} / {a.num_query_groups} × {a.head_dim}, "
        f"{ffn}, {a.vocab_size}"
    )


def _docs_rows() -> list[list[str]]:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    section = text.split("## Model presets", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("| ").split(" | ") for line in section.splitlines() if line.startswith("| ")]
    return rows[2:]  # after the header and the separator


def test_the_benches_take_the_runtime_presets_of_the_families_they_write():
    assert PRESETS == {n: a for n, a in MODEL_PRESETS.items() if a.family in ("qwen3", "qwen3_moe")}
    assert set(MODEL_PRESETS) - set(PRESETS) == {"tiny-moe-shared-4l"}


def test_docs_table_describes_every_preset():
    rows = _docs_rows()
    assert [r[0] for r in rows] == list(MODEL_PRESETS)
    for name, family, shape, params, size, _ in rows:
        arch = MODEL_PRESETS[name]
        assert (family, shape) == (arch.family, _shape(arch)), name
        count, unit = params.split()
        assert _params(arch) == pytest.approx(float(count) * _SUFFIX[unit], rel=0.01), name
        value, unit = size.split()
        assert 4 * _params(arch) == pytest.approx(float(value) * _MIB[unit], rel=0.03), name


def test_documented_commands_name_presets():
    """Every `--model X` / `--preset X` in the docs, the README and the bench tools is a preset."""
    files = [
        ROOT / "README.md",
        ROOT / "docs" / "benchmarks.md",
        *sorted(ROOT.glob("tools/bench_*.py")),
        *sorted(ROOT.glob("megatron_rl_lab/bench/*.py")),
    ]
    named = {
        (f.name, m)
        for f in files
        for m in re.findall(r"--(?:model|preset)[ =]((?:tiny|cpu|gpu)-[\w-]+)", f.read_text())
    }
    assert named, "the pattern found no command at all"
    assert {(f, m) for f, m in named if m not in PRESETS} == set()
    used = {m for _, m in named} | {n for n in PRESETS if n.startswith("tiny-")}  # the tiny ones: tests, recipes
    assert used == set(PRESETS), "a preset no documented command uses"


def test_every_bench_can_take_every_preset():
    """The weight-sync and rollout benches write presets as HF models; all fit TP2, PP2 (and EP2)."""
    from megatron_rl_lab.testing.hf_models import hf_config

    for name, arch in PRESETS.items():
        config = hf_config(arch)
        assert config.num_hidden_layers == arch.num_layers, name
        for layout in (
            ParallelConfig(tensor_model_parallel_size=2),
            ParallelConfig(pipeline_model_parallel_size=2),
            *([ParallelConfig(expert_model_parallel_size=2)] if arch.is_moe else []),
        ):
            layout.validate(2, arch.shape())


def test_resolve_model_reads_a_config_and_rejects_old_names(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "qwen3", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, '
        '"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, '
        '"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64, "tie_word_embeddings": false}'
    )
    arch = resolve_model(str(tmp_path))
    assert (arch.family, arch.hidden_size, arch.num_layers, arch.head_dim) == ("qwen3", 64, 2, 16)
    for old in ("cpu-dense", "cpu-moe", "cpu-dense-big"):  # each named two models once
        with pytest.raises(ValueError, match="neither a preset"):
            resolve_model(old)
