"""model.ckpt is checked before any model is built: the step an RL run starts from must be a
policy's full weights of the base's architecture, each refusal one line naming what is wrong."""

import json

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.from_config.start_checks import StartCheckpoint, start_checkpoint


@pytest.fixture(scope="module")
def saved(world_of_one, tmp_path_factory):
    """A tiny qwen3 saved as a trainer saves (extra hf_config), as a reward model's, and as a
    LoRA run's adapters-only step; and a base of another architecture."""
    from megatron_rl import checkpoint
    from megatron_rl.bridge.load import load_hf
    from megatron_rl.bridge.parity import make_tiny_hf
    from megatron_rl.models.builder import BuildOptions, build_model
    from megatron_rl.models.hf_config import arch_from_hf
    from megatron_rl.parallel import ParallelConfig

    work = tmp_path_factory.mktemp("start")
    base = make_tiny_hf("qwen3", work / "base", seed=1)
    other = make_tiny_hf("qwen3", work / "other", seed=1, num_hidden_layers=3)
    (model,) = build_model("actor", arch_from_hf(base), ParallelConfig(), BuildOptions())
    load_hf([model], base, arch_from_hf(base))
    hf_config = json.loads((base / "config.json").read_text())
    extras = {
        "policy": {"hf_config": hf_config},
        "reward_model": {"hf_config": hf_config, "model_role": "reward_model"},
        "adapters": {"hf_config": hf_config, "lora": {"rank": 8, "alpha": 16, "adapters_only": True}},
        "no_config": {},
    }
    with checkpoint.Checkpointer() as ckpt:
        for name, extra in extras.items():
            ckpt.save(work / name, 3, model=[model], extra=extra).wait()
    return dict(work=work, base=base, other=other)


def _cfg(ckpt, *overrides):
    return load_config(None, [f"model.ckpt={ckpt}", *overrides])


def test_a_policys_checkpoint_of_the_bases_architecture_is_where_the_run_starts(saved):
    assert start_checkpoint(_cfg(saved["work"] / "policy"), saved["base"]) == StartCheckpoint(
        saved["work"] / "policy", 3
    )
    assert start_checkpoint(load_config(None, []), saved["base"]) is None


@pytest.mark.parametrize(
    "case,base,overrides,message",
    [
        ("missing", "base", [], r"model.ckpt=.*missing: "),
        ("reward_model", "base", [], r"step 3 is a reward model's: an actor starts from a policy's checkpoint"),
        ("adapters", "base", [], r"step 3 holds LoRA adapters only: export it merged"),
        (
            "policy",
            "base",
            ["model.lora={rank: 4}"],
            r"model.ckpt with model.lora: a LoRA run's base is an HF directory",
        ),
        ("no_config", "base", [], r"step 3 records no HF architecture"),
        ("policy", "other", [], r"step 3 is a model of another architecture than this run's base"),
    ],
)
def test_a_checkpoint_the_run_cannot_start_from_is_refused_in_one_line(saved, case, base, overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        start_checkpoint(_cfg(saved["work"] / case, *overrides), saved[base])
    assert "\n" not in str(err.value)
