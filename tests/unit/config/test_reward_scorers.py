"""The ``reward.scorers`` section and its checks: each bad scorer is one line naming the key
and what is allowed, before any model is built; a model scorer's reward model must tokenize
as the policy does."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.from_config import validate
from megatron_rl.from_config.scorer_checks import check_scorer_tokenizers, reward_model_root

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
GRPO = str(EXAMPLES / "grpo.yaml")


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "reward.scorers={a: {kind: critic}}",
            "reward.scorers.a.kind='critic' is not a scorer kind; allowed: ['rule', 'model', 'judge']",
        ),
        ("reward.scorers={a: {kind: judge}}", "reward.scorers.a.path must name the judge's HF directory, or base"),
        (
            "reward.scorers={a: {kind: judge, path: base, template: 'Is {response} right?'}}",
            "template has no {question}",
        ),
        (
            "reward.scorers={a: {kind: judge, path: base, template: '{question} {answer}'}}",
            "template has the placeholder {answer}; allowed: ['question', 'response', 'reference']",
        ),
        (
            "reward.scorers={a: {kind: judge, path: base, template: '{question {response}'}}",
            "template is not a valid template",
        ),
        (
            "reward.scorers={a: {kind: judge, path: base, verdict_pattern: 'yes|no'}}",
            "needs a group ( ... ): the verdict it captures",
        ),
        ("reward.scorers={a: {kind: judge, path: base, verdict_pattern: '(yes'}}", "is not a regular expression"),
        (
            "reward.scorers={a: {kind: judge, path: base, verdict_scores: {'yes': high}}}",
            "verdict_scores['yes']='high' must be a number",
        ),
        ("reward.scorers={a: {kind: judge, path: base, timeout_s: 0}}", "must be > 0"),
        (
            "reward.scorers={a: {kind: judge, path: base, verdict_scores: {yes: 1}}}",
            "verdict_scores key True is not a string: quote it, e.g. 'yes': 1",
        ),
        ("reward.scorers={a: {kind: rule, template: x}}", "reward.scorers.a.template does not apply to kind: rule"),
        (
            "reward.scorers={a: {kind: judge, path: base, step: 3}}",
            "reward.scorers.a.step does not apply to kind: judge",
        ),
        ("reward.scorers={a: {}}", "reward.scorers.a.kind='' is not a scorer kind"),
        ("reward.scorers={a: {kind: rule, weight: heavy}}", "reward.scorers.a.weight='heavy' is not a valid float"),
        ("reward.scorers={a: {kind: rule, weight: .nan}}", "reward.scorers.a.weight=nan must be a finite number"),
        ("reward.scorers={a: {kind: model}}", "reward.scorers.a.path must name the reward model's run directory"),
        ("reward.scorers={a: {kind: rule, path: x}}", "reward.scorers.a.path does not apply to kind: rule"),
        (
            "reward.scorers={a: {kind: model, path: x, reward: math}}",
            "reward.scorers.a.reward does not apply to kind: model",
        ),
        (
            "reward.scorers={a: {kind: model, path: x, engine: sglang}}",
            "reward.scorers.a.engine='sglang' is not allowed; choose one of ['megatron', 'vllm']",
        ),
        (
            "reward.scorers={a: {kind: model, path: x, timeout_s: 5}}",
            "reward.scorers.a.timeout_s does not apply to kind: model",  # only served, on engine vllm
        ),
        ("reward.scorers={a: {kind: model, path: x, engine: vllm, batch_size: 0}}", "must be > 0"),
        ("reward.scorers={a: {kind: rule, weight: 0}}", "every weight is 0, so nothing would be trained on"),
        ("reward.scorers={'a b': {kind: rule}}", "reward.scorers name 'a b' must be letters, digits"),
        ("reward.scorers={a: {kind: rule, colour: red}}", "unknown config key 'reward.scorers.a.colour'"),
    ],
)
def test_a_bad_scorer_is_one_line(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(GRPO, [override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_checks_of_the_run(tmp_path):
    def fails(overrides, message):
        with pytest.raises(ConfigError) as err:
            validate(load_config(GRPO, overrides), 1)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)

    fails(["reward.scorers={v: {kind: rule, reward: nope}}"], "reward.scorers.v.reward='nope' is not allowed; choose")
    fails(
        [f"reward.scorers={{rm: {{kind: model, path: {tmp_path}}}}}"],
        f"reward.scorers.rm.path='{tmp_path}': ",
    )
    fails(
        ["reward.scorers={v: {kind: rule}}", "environment.name=tools", "environment.tools=[python]"],
        "episodes are scored by their environment; reward.scorers applies to single_turn runs",
    )
    fails(
        [f"reward.scorers={{j: {{kind: judge, path: {tmp_path}}}}}"],
        f"reward.scorers.j.path='{tmp_path}' has no config.json: a judge is an HF model directory",
    )
    validate(load_config(GRPO, ["reward.scorers={v: {kind: rule}, d: {kind: rule, reward: digits, weight: 0.5}}"]), 1)
    validate(load_config(GRPO, ["reward.scorers={v: {kind: rule}, j: {kind: judge, path: base, weight: 0}}"]), 1)


def test_the_cli_exits_2_on_a_missing_reward_model(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rl",
            "train",
            "--config",
            GRPO,
            f"reward.scorers={{rm: {{kind: model, path: {tmp_path}}}}}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if "reward.scorers.rm.path" in line]
    assert len(lines) == 1, result.stderr


def test_a_run_directory_or_its_checkpoints(tmp_path):
    assert reward_model_root(tmp_path) == tmp_path
    (tmp_path / "checkpoints").mkdir()
    assert reward_model_root(tmp_path) == tmp_path / "checkpoints"


def test_a_reward_model_of_another_tokenizer_is_refused(tmp_path, monkeypatch):
    rm_base, policy = tmp_path / "rm", tmp_path / "policy"
    for d, vocab in ((rm_base, {"a": 0}), (policy, {"a": 0})):
        d.mkdir()
        (d / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    cfg = load_config(GRPO, [f"reward.scorers={{rm: {{kind: model, path: {tmp_path}}}}}"])
    extra = {"hf_source_dir": str(rm_base)}
    monkeypatch.setattr("megatron_rl.from_config.scorer_checks.reward_model_extra", lambda where, s: extra)
    check_scorer_tokenizers(cfg, policy)  # the same files: accepted
    (policy / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"b": 0}}}))
    with pytest.raises(
        ConfigError, match=r"reward.scorers.rm: the reward model cannot score the policy's text: its tokenizer.json"
    ):
        check_scorer_tokenizers(cfg, policy)
