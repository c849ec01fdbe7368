"""data.source=reasoning_gym:<dataset> in the one validation pass: the example recipe
validates, and a bad dataset, option or reward is one line with exit code 2."""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.data.reasoning_gym import GymSpec
from megatron_rl.from_config import base_settings, validate
from megatron_rl.from_config.sources import gym_spec, prompt_file
from megatron_rl.tasks.gym_base import GymBaseSettings

RECIPE = str(Path(__file__).resolve().parents[3] / "examples" / "dapo_reasoning_gym.yaml")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_rl", *args], capture_output=True, text=True, timeout=300)


def test_the_example_recipe_validates_on_one_rank():
    proc = _cli("layout", "--world-size", "1", "--config", RECIPE)
    assert proc.returncode == 0, proc.stderr


def test_an_option_the_dataset_rejects_is_one_line_and_exit_2():
    proc = _cli("layout", "--world-size", "1", "--config", RECIPE, "data.options.max_n=0")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "megatron-rl: config error: data.source='reasoning_gym:count_bits': reasoning-gym rejects "
        "count_bits options {'min_n': 1, 'max_n': 0}: min_n must be between 1 and max_n"
    ]


def test_the_spec_and_the_base_follow_the_config():
    cfg = load_config(RECIPE, [])
    spec = gym_spec(cfg)
    assert spec == GymSpec("count_bits", {"min_n": 1, "max_n": 31}, seed=cfg.trainer.seed, size=1000)
    assert prompt_file(cfg) is None  # reasoning-gym generates the prompts
    settings = base_settings(cfg)
    assert isinstance(settings, GymBaseSettings) and settings.spec == spec
    assert settings.model_shape().num_moe_experts == 8
    other = base_settings(load_config(RECIPE, ["data.options.max_n=63", "data.seed=7"]))
    assert other.spec.seed == 7 and other.content_hash() != settings.content_hash()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.source=reasoning_gym:count_bitz"], "no dataset 'count_bitz'; did you mean count_bits"),
        (["data.options.max_m=3"], r"count_bits has no option 'max_m'; allowed: \['max_n', 'min_n'\]"),
        (["data.reward=math"], "reasoning_gym:<dataset> data is scored by data.reward=reasoning_gym"),
        (["data.source=task:digits_max", "data.options={}", "data.reward=reasoning_gym"], "needs data.source="),
    ],
)
def test_bad_gym_settings_are_refused_by_the_validation_pass(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(RECIPE, overrides), 1)


def test_options_belong_to_gym_sources_and_the_seed_to_built_data():
    with pytest.raises(ConfigError, match="apply to reasoning_gym:<dataset> sources only"):
        load_config(None, ["data.options.max_n=3"])
    with pytest.raises(
        ConfigError,
        match="data.seed applies to task:<name>, pairs:task:<name> and reasoning_gym:<dataset> sources only, "
        "not 'p.jsonl'",
    ):
        load_config(None, ["data.source=p.jsonl", "model.hf_path=m", "data.seed=3"])


def test_data_seed_fixes_the_base_while_the_trainer_seed_varies():
    """The runs of a multi-seed comparison: one base (same settings hash) for every trainer.seed."""
    for recipe in (None, RECIPE):
        one, other = (base_settings(load_config(recipe, ["data.seed=5", f"trainer.seed={s}"])) for s in (1, 2))
        assert one.content_hash() == other.content_hash()
        default = base_settings(load_config(recipe, ["trainer.seed=5"]))
        assert default.content_hash() == one.content_hash()  # data.seed=5 is what trainer.seed=5 built
        assert base_settings(load_config(recipe, ["trainer.seed=1"])).content_hash() != one.content_hash()
    with pytest.raises(ConfigError, match="data.size=0 must be >= 1"):
        load_config(RECIPE, ["data.size=0"])
