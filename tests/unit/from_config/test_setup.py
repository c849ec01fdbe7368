"""The trainer starts from the model validation checked: the task base of
config.sources.base_settings, or model.hf_path; prompts from the same file validation read."""

from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.from_config import base_settings, model_shape, setup, verifier_name
from megatron_rl.tasks.base_model import BaseModelSettings


@pytest.fixture
def built(monkeypatch):
    """The settings base_model_dir builds with (the build itself is stubbed)."""
    calls = []
    monkeypatch.delenv(setup.BASE_CACHE_ENV, raising=False)  # the test session sets one
    monkeypatch.setattr("megatron_rl.tasks.base_model.make_tiny_base", lambda d, s: calls.append((Path(d), s)))
    monkeypatch.setattr(setup.torch.distributed, "barrier", lambda: None)
    return calls


@pytest.mark.parametrize("preset, family", [("tiny-moe", "qwen3_moe"), ("tiny-dense", "qwen3")])
def test_task_runs_build_the_base_validation_checked(built, tmp_path, preset, family):
    cfg = load_config(
        None, [f"model.preset={preset}", "data.source=task:digits_sum", "trainer.seed=7", f"trainer.run_dir={tmp_path}"]
    )
    directory = setup.base_model_dir(cfg, rank=0)
    assert built == [(tmp_path / "base_model", base_settings(cfg))]
    assert built[0][1] == BaseModelSettings(task="digits_sum", family=family, seed=7)
    assert model_shape(cfg) == built[0][1].model_shape()
    assert setup.prompt_files(cfg, directory) == [tmp_path / "base_model" / "train.jsonl"]
    assert verifier_name(cfg) == "digits"


def test_a_base_cache_holds_the_base_under_its_settings_hash(built, tmp_path, monkeypatch):
    monkeypatch.setenv(setup.BASE_CACHE_ENV, str(tmp_path / "bases"))
    runs = [load_config(None, [f"trainer.run_dir={tmp_path / name}"]) for name in ("a", "b")]
    other = load_config(None, [f"trainer.run_dir={tmp_path / 'c'}", "trainer.seed=8"])
    directories = [setup.base_model_dir(cfg, rank=0) for cfg in (*runs, other)]
    digest = base_settings(runs[0]).content_hash()
    assert directories[:2] == [tmp_path / "bases" / digest] * 2
    assert directories[2] == tmp_path / "bases" / base_settings(other).content_hash() != directories[0]


def test_hf_path_runs_build_nothing(built, tmp_path):
    cfg = load_config(None, [f"model.hf_path={tmp_path}", f"data.source={tmp_path / 'p.parquet'}"])
    assert setup.base_model_dir(cfg, rank=0) == tmp_path and built == []
    assert setup.prompt_files(cfg, tmp_path) == [tmp_path / "p.parquet"]
    assert verifier_name(cfg) == "math"


def test_lora_builds_the_local_layers_and_sequential_experts_it_adapts():
    from megatron_rl.from_config.setup import build_options

    plain = build_options(load_config(None, []))
    assert (plain.attention, plain.experts) == ("auto", "auto")
    experts = build_options(load_config(None, ["model.lora={targets: [qkv, experts]}"]))
    assert (experts.attention, experts.experts) == ("sdpa", "sequential")
    attention = build_options(load_config(None, ["model.lora={targets: [qkv]}"]))
    assert (attention.attention, attention.experts) == ("sdpa", "auto")


def test_a_dense_lora_actors_engines_get_a_slot_for_the_hf_modules_it_adapts():
    from megatron_rl_lab.testing.tiny import TINY_DENSE

    cfg = load_config(None, ["model.lora={rank: 4, targets: [qkv, fc2, experts], sync: adapter}"])
    assert setup.syncs_adapters(cfg) and not setup.syncs_adapters(load_config(None, ["model.lora={rank: 4}"]))
    engine = setup.engine_config(cfg, TINY_DENSE, None, lora_slot=True)
    # QKV is q, k and v in HF (and in vLLM's packed qkv_proj); FC2 is down_proj; experts: none here
    assert (engine.lora_rank, engine.lora_modules) == (4, ("down_proj", "k_proj", "q_proj", "v_proj"))
    assert setup.engine_config(cfg, TINY_DENSE, None).lora_rank == 0
    assert not setup.syncs_adapters(load_config(None, []))
