"""The environment section: its own fields, and the one-line refusals of what multi-turn
episodes do not run with yet (exit 2 before any model is built)."""

from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.environments.isolation import IsolationReport
from megatron_rl.from_config import validate

TOOLS = str(Path(__file__).resolve().parents[3] / "examples" / "tool_grpo.yaml")


def test_the_default_is_single_turn_and_the_tool_recipe_validates():
    assert not load_config(None, []).environment.episodes
    cfg = validate(load_config(TOOLS, []), 1)
    assert cfg.environment.episodes and cfg.environment.tools == ("python",)
    off = validate(load_config(TOOLS, ["environment.name=single_turn", "environment.tools=[]"]), 1)
    assert not off.environment.episodes
    assert validate(load_config(TOOLS, ["rollout.seed_per_prompt=true"]), 1).rollout.seed_per_prompt


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["environment.max_turns=0"], "environment.max_turns=0 must be >= 1"),
        (["environment.tools=[]"], "environment.name=tools needs environment.tools, e.g. [python]"),
        (["environment.name=single_turn"], "environment.tools=['python'] needs a multi-turn environment"),
        (["environment.tools=[python, python]"], "names a tool twice"),
        (["environment.sandbox.timeout_s=0"], "environment.sandbox.timeout_s must be 0 < timeout_s <= 600"),
        (["environment.sandbox.nope=1"], "unknown config key 'environment.sandbox.nope'"),
    ],
)
def test_the_section_checks_its_own_fields_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        load_config(TOOLS, overrides)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["environment.name=chat"], 1, "environment.name='chat' is not allowed; choose one of"),
        (["environment.parser=json"], 1, "environment.parser='json' is not allowed"),
        (["environment.tools=[shell]"], 1, "environment.tools: tool 'shell' is not known; allowed: ['python']"),
        (
            ["rollout.tensor_parallel_size=2"],
            2,
            "is not supported yet with rollout.tensor_parallel_size=2 .each vLLM replica runs its episodes' tools",
        ),
        (
            ["rollout.placement=disaggregated", "rollout.num_ranks=2", "rollout.tensor_parallel_size=2"],
            3,
            "is not supported yet with rollout.tensor_parallel_size=2",
        ),
        (
            [
                "rollout.placement=disaggregated",
                "rollout.num_ranks=1",
                "rollout.max_staleness=1",
                "rollout.partial=true",
                "algorithm.overrides={rollout_correction: {kind: token_tis, cap: 2.0}}",
            ],
            2,
            "is not supported yet with rollout.partial=true",
        ),
        (["algorithm.recipe=tppo"], 1, "is not supported yet with generation_window"),
        (["algorithm.recipe=hapo"], 1, "is not supported yet with the HAPO pieces"),
        (
            ["rollout.seed_per_prompt=true", "rollout.n_samples=64", "environment.max_turns=65"],
            1,
            "rollout.seed_per_prompt=true gives a prompt's episodes 4096 seeds, one per turn: rollout.n_samples=64",
        ),
        (
            ["eval.sets={held_out: {source: held_out}}", "eval.at_end=true"],
            1,
            "is not supported yet with eval",
        ),
        (["environment.max_episode_tokens=400"], 1, "environment.max_episode_tokens=400 must be <= trainer.seq_length"),
        (["rollout.parity_every=1"], 1, "rollout.parity_every=1 scores whole episodes in vLLM, which needs a position"),
    ],
)
def test_what_episodes_do_not_cover_is_refused_in_one_line(overrides, world, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")) as err:
        validate(load_config(TOOLS, overrides), world)
    assert "\n" not in str(err.value)


def test_a_missing_isolation_is_refused_unless_the_config_opts_out(monkeypatch):
    weak = IsolationReport(False, True, True, True, "user namespace", True, "/usr/bin/unshare", ("net: denied",))
    monkeypatch.setattr("megatron_rl.environments.isolation.probe_isolation", lambda: weak)
    with pytest.raises(ConfigError, match="environment.sandbox: the Python tool's sandbox cannot have network"):
        validate(load_config(TOOLS, []), 1)
    validate(load_config(TOOLS, ["environment.sandbox.allow_weaker_isolation=true"]), 1)
