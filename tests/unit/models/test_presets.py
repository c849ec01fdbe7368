"""One preset table (models.presets): each name one architecture, and every caller's name
(the recipes, the smoke job, the tests' roles, the benches) resolves through it."""

import types
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.from_config import base_settings, model_arch
from megatron_rl.models.hf_config import arch_from_hf
from megatron_rl.models.presets import PRESETS, preset
from megatron_rl.tasks.base_model import BaseModelSettings

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
# The settings hash of `make train`'s base (examples/dapo.yaml): the cache name of a model
# whose reward curve examples/reference records. A new hash means a different base model
# (build version 2: built on one thread, the same at every world size).
EMBEDDED_DEFAULT_BASE_HASH = "94df719a1520d478"


def test_every_name_denotes_one_architecture():
    archs = list(PRESETS.values())
    assert all(archs.count(a) == 1 for a in archs), "two names build the same model"
    with pytest.raises(ValueError, match="presets: tiny-moe, tiny-dense, tiny-dense-4l"):
        preset("tiny")


def test_the_recipes_task_base_is_the_preset_they_name():
    cfg = load_config(str(EXAMPLES / "dapo.yaml"), [])
    settings = base_settings(cfg)
    assert cfg.model.preset == "tiny-moe"
    assert settings == BaseModelSettings(task="digits_max", family="qwen3_moe", seed=1234)
    assert settings.content_hash() == EMBEDDED_DEFAULT_BASE_HASH
    for name in ("tiny-moe", "tiny-dense"):
        base = base_settings(load_config(str(EXAMPLES / "dapo.yaml"), [f"model.preset={name}"]))
        fields = base.hf_fields(base.tokenizer_vocab_size)
        assert arch_from_hf(types.SimpleNamespace(**fields)) == PRESETS[name]


def test_a_preset_no_task_base_can_have_is_refused_for_rl_in_one_line():
    cfg = load_config(str(EXAMPLES / "dapo.yaml"), ["model.preset=gpu-dense-1b"])
    with pytest.raises(ConfigError, match="model.preset='gpu-dense-1b': .* differ in rope_theta"):
        base_settings(cfg)
    with pytest.raises(ConfigError, match="model.preset='tiny' is not allowed"):
        load_config(None, ["model.preset=tiny"])


def test_the_smoke_job_builds_the_preset_it_names():
    cfg = load_config(str(EXAMPLES / "smoke.yaml"), [])
    assert cfg.model.preset == "tiny-moe-shared-4l" and model_arch(cfg) is PRESETS["tiny-moe-shared-4l"]
    dense = load_config(str(EXAMPLES / "smoke.yaml"), ["model.preset=tiny-dense-4l"])
    assert model_arch(dense) is PRESETS["tiny-dense-4l"]


def test_the_tests_and_the_benches_name_models_of_the_same_table():
    from megatron_rl_lab.bench.presets import PRESETS as BENCH_PRESETS
    from megatron_rl_lab.testing.tiny import ROLES, TINY_ARCHS, TINY_QWEN3_MOE

    assert {role: PRESETS[name] for role, name in ROLES.items()} == TINY_ARCHS
    assert TINY_QWEN3_MOE is PRESETS["tiny-moe-4l"]
    assert all(arch is PRESETS[name] for name, arch in BENCH_PRESETS.items())
