"""Config tree: YAML + dotted overrides, clear errors, fast failures, round trip."""

import subprocess
import sys

import pytest

from megatron_rl.config import ConfigError, dump_yaml, load_config
from megatron_rl.from_config import validate


def test_overrides_are_typed_and_applied(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("trainer:\n  max_steps: 5\nparallel:\n  tensor_model_parallel_size: 2\n")
    cfg = load_config(
        path,
        [
            "trainer.max_steps=7",
            "trainer.lr=0.5",
            "parallel.sequence_parallel=false",
            "parallel.virtual_pipeline_model_parallel_size=none",
        ],
    )
    assert cfg.trainer.max_steps == 7 and cfg.trainer.lr == 0.5
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.parallel.sequence_parallel is False
    assert cfg.parallel.virtual_pipeline_model_parallel_size is None


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["parallel.expert_model_parallel_size=2", "model.dtype=bf16"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_yaml(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize(
    "override, message",
    [
        ("parallel.foo=1", "unknown config key 'parallel.foo'; allowed in parallel: ["),
        ("nosection.x=1", "unknown config key 'nosection'"),
        ("trainer.max_steps=abc", "trainer.max_steps='abc' is not a valid int"),
        ("trainer.max_steps=0", "trainer.max_steps=0 must be >= 1"),
        ("trainer.dist_timeout_s=0", "trainer.dist_timeout_s=0.0 must be > 0"),
        ("model.dtype=fp8", "model.dtype='fp8' is not allowed; choose one of ['bf16', 'fp16', 'fp32']"),
        ("parallel.sequence_parallel=maybe", "is not a valid bool"),
        ("trainer.max_steps", "must look like key=value"),
        ("rollout.parity_threshold=0", "rollout.parity_threshold=0.0 must be > 0 (or null: the dtype's limits)"),
        ("rollout.kv_cache_gib=0.25", "rollout.kv_cache_gib=0.25 must be a whole number >= 1"),
        ("rollout.timeout_s=0", "rollout.timeout_s=0.0 must be > 0"),
        ("rollout.start_timeout_s=-1", "rollout.start_timeout_s=-1.0 must be > 0"),
    ],
)
def test_bad_keys_and_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_layout_checked_against_model_and_world():
    cfg = load_config(None, ["parallel.expert_model_parallel_size=3"])
    # The RL default's model is the digit task's base: qwen3_moe with 8 experts.
    with pytest.raises(ConfigError, match="expert_model_parallel_size=3 does not divide num_moe_experts=8"):
        validate(cfg, 3)
    # The smoke job builds its preset as it stands (4 experts here) and splits global_batch_size.
    smoke = load_config(
        None, ["trainer.job=smoke", "model.preset=tiny-moe-shared-4l", "parallel.expert_model_parallel_size=8"]
    )
    with pytest.raises(ConfigError, match="expert_model_parallel_size=8 does not divide num_moe_experts=4"):
        validate(smoke, 8)
    with pytest.raises(ConfigError, match="global_batch_size=8 must be a multiple .* = 4x4 \\(trainer.job=smoke\\)"):
        validate(load_config(None, ["trainer.job=smoke", "trainer.micro_batch_size=4"]), 4)
    validate(load_config(None, ["trainer.micro_batch_size=4"]), 4)  # RL ignores global_batch_size


def test_critic_layout_is_its_own_section_or_the_actors():
    cfg = load_config(None, ["parallel.expert_model_parallel_size=2"])
    assert cfg.critic_parallel is None and cfg.critic_layout == cfg.parallel
    cfg = load_config(None, ["parallel.tensor_model_parallel_size=2", "critic_parallel.pipeline_model_parallel_size=2"])
    assert cfg.critic_layout.pp == 2 and cfg.critic_layout.tp == 1 and cfg.parallel.tp == 2
    assert load_config(None, ["critic_parallel=null"]).critic_parallel is None
    validate(cfg, 4)


def test_critic_layout_round_trips_and_is_checked(tmp_path):
    cfg = load_config(None, ["critic_parallel.expert_model_parallel_size=4"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_yaml(cfg))
    assert load_config(path) == cfg
    with pytest.raises(ConfigError, match="critic_parallel: world size 2 is not divisible by expert_tensor_parallel"):
        validate(cfg, 2)
    with pytest.raises(ConfigError, match="critic_parallel: expert_model_parallel_size=3 does not divide num_moe"):
        validate(load_config(None, ["critic_parallel.expert_model_parallel_size=3", "trainer.global_batch_size=6"]), 3)
    # A PPO step's rows split over the lcm of both DP sizes: 4 x 8 x 1 rows > 3 groups of 8.
    rows = [
        "algorithm.recipe=ppo",
        "trainer.micro_batch_size=8",
        "rollout.prompts_per_step=3",
        "parallel.tensor_model_parallel_size=2",
        "critic_parallel.tensor_model_parallel_size=1",
    ]
    with pytest.raises(
        ConfigError, match="prompts_per_step=3 groups of rollout.n_samples=8 cannot fill one training batch of 32 rows"
    ):
        validate(load_config(None, rows), 4)
    validate(load_config(None, rows[:-1] + ["critic_parallel.tensor_model_parallel_size=2"]), 4)  # 16 rows fit
    with pytest.raises(ConfigError, match="unknown config key 'critic_parallel.tp'"):
        load_config(None, ["critic_parallel.tp=2"])
    with pytest.raises(ConfigError, match="critic_parallel must be a mapping of its keys or null, got 2"):
        load_config(None, ["critic_parallel=2"])


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_rl", *args], capture_output=True, text=True, timeout=60)


def test_cli_help_lists_commands():
    proc = _cli("--help")
    assert proc.returncode == 0
    for word in ("train", "layout", "config", "monitor", "key=value"):
        assert word in proc.stdout


def test_cli_bad_layout_fails_before_torch_is_imported():
    code = (
        "import sys\nfrom megatron_rl.cli import main\n"
        "rc = main(['train', 'parallel.expert_model_parallel_size=3'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported before the config was rejected'\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "config error: parallel: world size 1 is not divisible by expert_tensor_parallel_size" in proc.stderr


def test_cli_config_refuses_an_unknown_recipe(capsys):
    from megatron_rl.cli import main

    assert main(["config", "algorithm.recipe=nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope" in err[0] and "dapo" in err[0], err


def test_cli_layout_prints_rank_map():
    proc = _cli(
        "layout",
        "--world-size",
        "8",
        "parallel.tensor_model_parallel_size=2",
        "parallel.pipeline_model_parallel_size=2",
        "parallel.expert_model_parallel_size=4",
        "parallel.expert_tensor_parallel_size=1",
    )
    assert proc.returncode == 0, proc.stderr
    assert "dense TP2·CP1·DP2·PP2 | MoE ETP1·EP4·EDP1·PP2" in proc.stdout
    assert "    7 |  1  0  1  1 |   0  3   0" in proc.stdout


def test_the_lora_section_is_checked_in_one_line():
    cfg = load_config(None, ["model.lora={rank: 4, alpha: 8}"])
    lora = cfg.model.lora
    assert (lora.rank, lora.alpha, lora.targets) == (4, 8.0, ["qkv", "proj", "fc1", "fc2", "experts"])
    assert load_config(None, []).model.lora is None
    assert lora.sync == "merged" and load_config(None, ["model.lora={sync: adapter}"]).model.lora.sync == "adapter"
    refusals = {
        "model.lora={rank: 0}": "model.lora.rank=0 must be an integer >= 1",
        "model.lora={alpha: -1}": "model.lora.alpha=-1.0 must be a number > 0",
        "model.lora={dropout: 1.5}": r"model.lora.dropout=1.5 must be in \[0, 1\)",
        "model.lora={targets: [gate]}": r"model.lora.targets=\['gate'\]: a non-empty list of qkv, proj, fc1, fc2, "
        "experts",
        "model.lora={sync: delta}": "model.lora.sync='delta'; allowed: merged, adapter",
    }
    for override, message in refusals.items():
        with pytest.raises(ConfigError, match=message):
            load_config(None, [override])
