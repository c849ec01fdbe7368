"""The eval section: off unless asked for, every bad value one line naming the key (exit 2
from the CLI before any model is built), and sets that training never draws from."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, dump_yaml, load_config
from megatron_rl.from_config import validate
from megatron_rl.tasks.base_model import BaseModelSettings

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
DAPO = str(EXAMPLES / "dapo.yaml")
ON = ("eval.sets.held_out.source=held_out", "eval.every=2")
GYM = ("eval.sets.g.source=reasoning_gym:count_bits",)


def test_off_by_default_and_due_when_asked():
    cfg = load_config(None, [])
    assert not cfg.eval.enabled and not cfg.eval.due(0, 10) and not cfg.eval.due(10, 10)
    ev = load_config(None, [*ON, "eval.at_start=true", "eval.at_end=true", "trainer.max_steps=7"]).eval
    assert ev.enabled
    assert [step for step in range(8) if ev.due(step, 7)] == [0, 2, 4, 6, 7]
    named_only = load_config(None, ["eval.sets.held_out.source=held_out"]).eval
    assert not named_only.enabled  # a set alone evaluates nothing
    assert not load_config(DAPO, ["eval.sets={}"]).eval.enabled  # a recipe's eval off in one override


def test_the_embedded_default_evaluates_its_held_out_split_at_start_every_few_steps_and_at_end():
    cfg = load_config(DAPO, [])
    validate(cfg, 1)
    ev = cfg.eval
    assert ev.at_start and ev.at_end and 0 < ev.every < cfg.trainer.max_steps
    assert {spec.source for spec in ev.sets.values()} == {"held_out"}
    assert max(ev.pass_k) == ev.n_samples


def test_round_trips_through_the_resolved_yaml(tmp_path):
    extra = ["eval.sets.extra.source=x.jsonl", "eval.sets.extra.max_prompts=5", "eval.pass_k=[1, 2]"]
    gym = [*GYM, "eval.sets.g.options={max_n: 63}", "eval.sets.g.seed=5", "eval.sets.g.size=20"]
    cfg = load_config(DAPO, [*extra, *gym])
    path = tmp_path / "config.yaml"
    path.write_text(dump_yaml(cfg))
    assert load_config(path, []) == cfg
    assert cfg.eval.sets["extra"].max_prompts == 5 and cfg.eval.pass_k == [1, 2]
    g = cfg.eval.sets["g"]
    assert (g.gym, g.options, g.seed, g.size) == (True, {"max_n": 63}, 5, 20) and not cfg.eval.sets["extra"].gym
    validate(load_config(DAPO, gym), 1)  # a reasoning-gym set beside a digit task: scored by its own reward


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["eval.every=-1"], "eval.every=-1 must be >= 0"),
        (["eval.n_samples=0"], "eval.n_samples=0 must be >= 1"),
        (["eval.temperature=-0.5"], "eval.temperature=-0.5 must be >= 0 (0: greedy)"),
        (["eval.temperature=0"], "eval.temperature=0 (greedy) draws the same response 4 times"),
        (["eval.top_p=0"], "eval.top_p=0.0 must be in (0, 1]"),
        (["eval.max_new_tokens=0"], "eval.max_new_tokens=0 must be >= 1"),
        (["eval.pass_k=[1, 8]"], "eval.pass_k=[1, 8]: each k must be in 1..eval.n_samples=4"),
        (["eval.pass_k=4"], "eval.pass_k=4 must be a list"),
        (["eval.pass_k=[a]"], "eval.pass_k[0]='a' is not a valid int"),
        (["eval.sets.held_out.max_prompts=0"], "eval.sets.held_out.max_prompts=0 must be >= 1"),
        (["eval.sets.held_out.max_prompts=a"], "eval.sets.held_out.max_prompts='a' is not a valid int"),
        (["eval.sets.held_out.sorce=x"], "unknown config key 'eval.sets.held_out.sorce'; allowed in"),
        (["eval.sets=[a]"], "eval.sets must be a mapping of names"),
        (["eval.sets.a/b.source=held_out"], "eval.sets: the name 'a/b' may hold only"),
        (["eval.sets.g.seed=3"], "eval.sets.g.seed applies to reasoning_gym:<dataset> sets only, not 'held_out'"),
        ([*GYM, "eval.sets.g.size=0"], "eval.sets.g.size=0 must be >= 1"),
        ([*GYM, "eval.sets.g.max_prompts=5"], "eval.sets.g.max_prompts applies to held_out and files; a reasoning_gym"),
        ([*GYM, "eval.sets.g.options=[3]"], "eval.sets.g.options must be a mapping of the dataset's options"),
        (
            [*GYM, "eval.sets.g.options={max_n:"],  # a flow mapping the shell split at its space
            "override eval.sets.g.options='{max_n:' is not valid YAML (quote it whole): while parsing a flow node",
        ),
    ],
)
def test_bad_values_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def _write_prompts(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["eval.sets.held_out.source=missing.jsonl"], "eval.sets.held_out.source='missing.jsonl': "),
        (["trainer.job=smoke", "trainer.micro_batch_size=4"], "eval needs trainer.job=rl"),
        (
            ["eval.sets.g.source=reasoning_gym:count_bitz"],
            "eval.sets.g.source='reasoning_gym:count_bitz': reasoning-gym has no dataset 'count_bitz'; did you mean",
        ),
        (
            [*GYM, "eval.sets.g.options={max_m: 3}"],
            "eval.sets.g.source='reasoning_gym:count_bits': count_bits has no option 'max_m'; allowed:",
        ),
        (
            [*GYM, "eval.sets.g.options={max_n: -3}"],
            "eval.sets.g.source='reasoning_gym:count_bits': reasoning-gym rejects count_bits options",
        ),
        (
            ["data.source=reasoning_gym:count_bits"],
            "eval.sets.held_out.source='held_out' needs task:<name> data; for reasoning_gym:count_bits data name "
            "a set of its own, e.g. eval.sets.held_out.source=reasoning_gym:count_bits",
        ),
    ],
)
def test_validation_refuses_what_eval_cannot_run(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(load_config(DAPO, overrides), 2)
    assert message in str(err.value) and "\n" not in str(err.value)


DISAGGREGATED = ("rollout.placement=disaggregated", "rollout.num_ranks=1")
AHEAD = ("rollout.max_staleness=1", "algorithm.overrides.rollout_correction={kind: token_tis, cap: 2.0}")


@pytest.mark.parametrize("overrides", [DISAGGREGATED, DISAGGREGATED + AHEAD], ids=["staleness0", "staleness1"])
def test_eval_runs_on_the_rollout_ranks_of_a_disaggregated_run(overrides):
    cfg = validate(load_config(DAPO, overrides), 2)  # the embedded default's eval stays on
    assert cfg.eval.enabled and cfg.rollout.placement == "disaggregated"


def test_file_sets_are_checked_and_may_not_be_the_training_data(tmp_path):
    good = _write_prompts(tmp_path / "held.jsonl", [{"prompt": "max of 1 2", "answer": "2"}])
    validate(load_config(DAPO, [*ON, f"eval.sets.file.source={good}"]), 1)
    bad = _write_prompts(tmp_path / "bad.jsonl", [{"question": "max of 1 2", "answer": "2"}])
    with pytest.raises(ConfigError, match=r"eval.sets.file.source=.*field 'prompt' is missing"):
        validate(load_config(DAPO, [*ON, f"eval.sets.file.source={bad}"]), 1)
    # A prompt-file run (from an HF directory) cannot name its own training file as a set,
    # nor a held-out split it does not have.
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(BaseModelSettings(family="qwen3").hf_fields(320)))
    run = [f"model.hf_path={tmp_path / 'hf'}", f"data.source={good}", "data.reward=digits"]
    with pytest.raises(ConfigError, match="eval.sets.held_out.source='held_out' needs task:<name> data"):
        validate(load_config(DAPO, run), 1)
    with pytest.raises(ConfigError, match="is the training data"):
        validate(load_config(DAPO, [*run, f"eval.sets.held_out.source={good}"]), 1)
    _write_prompts(tmp_path / "hf" / "train.jsonl", [{"prompt": "max of 1 2", "answer": "2"}])
    task_from_hf = [f"model.hf_path={tmp_path / 'hf'}", "data.source=task:digits_max"]
    with pytest.raises(ConfigError, match="eval.jsonl does not exist"):
        validate(load_config(DAPO, task_from_hf), 1)


def test_cli_refuses_a_bad_eval_config_in_one_line_before_building_anything(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rl",
            "train",
            "--config",
            DAPO,
            f"trainer.run_dir={tmp_path}",
            "eval.pass_k=[8]",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "megatron-rl: config error: eval.pass_k=[8]: each k must be in 1..eval.n_samples=4 "
        "(pass@k needs at least k samples per prompt), got [8]"
    ]
    assert list(tmp_path.iterdir()) == []  # nothing built, nothing written
