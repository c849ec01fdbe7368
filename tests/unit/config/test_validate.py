"""The one validation pass (config.checks.validate): it checks the model the trainer builds,
the recipe's compatibility, the rows a step trains, the prompt data and the names, and every
failure is one line naming the key (the CLI's exit code 2)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.from_config import base_settings, model_shape, validate
from megatron_rl.tasks import TASKS
from megatron_rl.tasks.base_model import BaseModelSettings

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
DAPO = str(EXAMPLES / "dapo.yaml")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_rl", *args], capture_output=True, text=True, timeout=300)


def test_cli_layout_fits_ep8_on_the_task_base_with_8_experts():
    proc = _cli("layout", "--world-size", "8", "--config", DAPO, "parallel.expert_model_parallel_size=8")
    assert proc.returncode == 0, proc.stderr
    assert "dense TP1·CP1·DP8·PP1 | MoE ETP1·EP8·EDP1·PP1 (world 8)" in proc.stdout


def test_cli_layout_refuses_pp4_on_the_2_layer_base_in_one_line():
    proc = _cli("layout", "--world-size", "4", "--config", DAPO, "parallel.pipeline_model_parallel_size=4")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "megatron-rl: config error: parallel: num_layers=2 is not divisible by pipeline_model_parallel_size x "
        "virtual_pipeline_model_parallel_size = 4x1"
    ]


def test_the_checked_shape_is_the_task_base_the_trainer_builds():
    cfg = load_config(DAPO, [])
    settings = base_settings(cfg)
    assert settings == BaseModelSettings(task="digits_max", family="qwen3_moe", seed=1234)
    shape = model_shape(cfg)
    assert (shape.num_layers, shape.num_moe_experts) == (settings.num_layers, settings.num_experts) == (2, 8)
    dense = load_config(DAPO, ["model.preset=tiny-dense"])
    assert base_settings(dense).family == "qwen3" and model_shape(dense).num_moe_experts is None
    with pytest.raises(ConfigError, match="need a MoE model; this model has no experts"):
        validate(load_config(DAPO, ["model.preset=tiny-dense", "parallel.expert_model_parallel_size=2"]), 2)


def test_the_default_config_is_valid():
    cfg = load_config(None, [])
    assert cfg.data.source == "task:digits_max"
    validate(cfg, 1)
    assert _cli("config").returncode == 0
    proc = _cli("layout", "--world-size", "1")
    assert proc.returncode == 0, proc.stderr


def test_critic_layout_is_checked_against_the_real_model():
    with pytest.raises(ConfigError, match="^critic_parallel: num_layers=2 is not divisible by pipeline"):
        validate(load_config(str(EXAMPLES / "ppo.yaml"), ["critic_parallel.pipeline_model_parallel_size=4"]), 4)
    validate(load_config(str(EXAMPLES / "ppo.yaml"), ["critic_parallel.pipeline_model_parallel_size=2"]), 2)


def _hf_dir(tmp_path: Path) -> Path:
    """A model directory whose config.json is the task base's (what validation reads of it)."""
    (tmp_path / "config.json").write_text(json.dumps(BaseModelSettings().hf_fields(vocab_size=320)))
    return tmp_path


def test_a_prompt_file_needs_hf_path(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    with pytest.raises(ConfigError, match="^model.hf_path must be set when data.source is a file"):
        validate(load_config(None, [f"data.source={data}"]), 1)
    validate(load_config(None, [f"data.source={data}", f"model.hf_path={_hf_dir(tmp_path)}"]), 1)


def test_a_missing_data_file_is_refused_before_torch(tmp_path):
    missing = tmp_path / "missing.jsonl"
    code = (
        "import sys\nfrom megatron_rl.cli import main\n"
        f"rc = main(['layout', '--world-size', '1', 'data.source={missing}', 'model.hf_path={_hf_dir(tmp_path)}'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported before the config was rejected'\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"megatron-rl: config error: data.source: {missing}: no such dataset file"]


def test_first_rows_need_the_prompt_and_answer_keys(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    hf = f"model.hf_path={_hf_dir(tmp_path)}"
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, [f"data.source={data}", hf]), 1)
    assert str(err.value) == (
        f"data.source: {data}:1: field 'prompt' is missing (row keys: ['answer', 'question']); "
        "data.prompt_key='prompt', data.answer_key='answer'"
    )
    validate(load_config(None, [f"data.source={data}", hf, "data.prompt_key=question"]), 1)


def test_task_data_with_hf_path_reads_its_train_jsonl(tmp_path):
    hf = f"model.hf_path={_hf_dir(tmp_path)}"
    with pytest.raises(ConfigError, match="with model.hf_path: .*train.jsonl: no such dataset file"):
        validate(load_config(None, [hf]), 1)
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "max of 3 7", "answer": "7"}) + "\n")
    validate(load_config(None, [hf]), 1)


def test_unknown_task_lists_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, ["data.source=task:digits"]), 1)
    assert str(err.value) == f"data.source='task:digits': task 'digits' is not known; allowed: {sorted(TASKS)}"


def test_unknown_reward_lists_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, ["data.reward=exact"]), 1)
    assert str(err.value) == (
        "data.reward='exact' is not allowed; choose one of ['auto', 'digit_chain', 'digits', 'math', 'reasoning_gym']"
    )
    validate(load_config(None, ["data.reward=math"]), 1)


def test_tppo_refuses_dynamic_sampling_hapo_pieces_and_prompt_seeds():
    tppo = str(EXAMPLES / "tppo.yaml")
    validate(load_config(tppo, []), 1)
    with pytest.raises(
        ConfigError,
        match="^algorithm: generation_window \\(tppo\\) cannot be combined with "
        "dynamic_sampling: responses finish at different steps",
    ):
        validate(load_config(tppo, ["algorithm.overrides.dynamic_sampling=true"]), 1)
    with pytest.raises(
        ConfigError, match="^algorithm: generation_window \\(tppo\\) cannot be combined with the HAPO pieces"
    ):
        validate(load_config(tppo, ["algorithm.overrides.temperature_tau=0.05"]), 1)
    with pytest.raises(ConfigError, match="^rollout.seed_per_prompt=true cannot be combined with generation_window"):
        validate(load_config(tppo, ["rollout.seed_per_prompt=true"]), 1)
    validate(load_config(DAPO, ["rollout.seed_per_prompt=true"]), 1)


def test_rows_per_step_must_fill_one_training_batch():
    # Padded rows, DAPO at DP8: 8 ranks x 8 rows x 2 mini-batches = 128 rows = 16 prompts x 8 samples.
    padded = "trainer.max_tokens_per_micro_batch=null"
    validate(load_config(DAPO, ["parallel.expert_model_parallel_size=8", padded]), 8)
    with pytest.raises(
        ConfigError,
        match="^rollout.prompts_per_step=8 groups of rollout.n_samples=8 cannot fill "
        "one training batch of 128 rows in whole groups",
    ):
        validate(load_config(DAPO, ["rollout.prompts_per_step=8", padded]), 8)
    # T-PPO trains any rows of its pool: the pool's own check, named after its config keys.
    with pytest.raises(
        ConfigError,
        match="^window pool: capacity=64 rows cannot fill one training batch of 128 "
        "rows .*raise rollout.prompts_per_step or rollout.n_samples",
    ):
        validate(load_config(str(EXAMPLES / "tppo.yaml"), ["rollout.prompts_per_step=8", padded]), 8)
    # Packed (the examples' default): 8 ranks x 2 mini-batches = 16 rows; 8 prompts x 8 samples fill it.
    validate(load_config(DAPO, ["rollout.prompts_per_step=8"]), 8)


def test_token_budget_is_checked_against_seq_length_and_tp():
    validate(load_config(DAPO, ["trainer.max_tokens_per_micro_batch=96"]), 1)
    with pytest.raises(
        ConfigError,
        match="^trainer.max_tokens_per_micro_batch=40 is smaller than "
        "trainer.seq_length=48, the longest sequence a micro-batch must hold$",
    ):
        load_config(DAPO, ["trainer.max_tokens_per_micro_batch=40"])
    with pytest.raises(
        ConfigError,
        match="^trainer.max_tokens_per_micro_batch=99 must be a multiple of 2: sequence parallelism splits "
        "every packed row over parallel.tensor_model_parallel_size=2$",
    ):
        validate(
            load_config(DAPO, ["trainer.max_tokens_per_micro_batch=99", "parallel.tensor_model_parallel_size=2"]), 2
        )
    # with packing a micro-batch holds any number of rows: 16 x 8 rows fill DP8 x 2 mini-batches
    # even with micro_batch_size=16 (padded rows would need 8 x 16 x 2 = 256)
    overrides = ["parallel.expert_model_parallel_size=8", "trainer.micro_batch_size=16", "trainer.global_batch_size=16"]
    with pytest.raises(ConfigError, match="one training batch of 256 rows"):
        validate(load_config(DAPO, [*overrides, "trainer.max_tokens_per_micro_batch=null"]), 8)
    validate(load_config(DAPO, [*overrides, "trainer.max_tokens_per_micro_batch=96"]), 8)


def test_sequences_must_split_into_two_chunks_per_cp_rank():
    """CP cuts every sequence into 2·CP chunks (times TP under sequence parallelism): padded
    rows by trainer.seq_length, packed rows by the token budget."""
    cp2 = ["parallel.context_parallel_size=2", "trainer.max_tokens_per_micro_batch=null"]
    validate(load_config(DAPO, cp2), 2)  # seq_length 48 = 4 chunks of 12
    with pytest.raises(
        ConfigError,
        match="^trainer.seq_length=50 must be a multiple of 4: parallel: context_parallel_size=2 splits "
        "every sequence into 2·CP chunks$",
    ):
        validate(load_config(DAPO, [*cp2, "trainer.seq_length=50"]), 2)
    cp2_tp2 = ["parallel.context_parallel_size=2", "parallel.tensor_model_parallel_size=2"]
    with pytest.raises(
        ConfigError,
        match="^trainer.max_tokens_per_micro_batch=100 must be a multiple of 8: parallel: context_parallel_size=2 "
        "splits every sequence into 2·CP chunks, each a multiple of tensor_model_parallel_size=2 "
        r"\(sequence parallelism\)$",
    ):
        validate(load_config(DAPO, [*cp2_tp2, "trainer.max_tokens_per_micro_batch=100"]), 4)
    validate(load_config(DAPO, [*cp2_tp2, "trainer.max_tokens_per_micro_batch=96"]), 4)


def test_the_cli_refuses_a_budget_below_seq_length_in_one_line():
    proc = _cli("config", "--config", DAPO, "trainer.max_tokens_per_micro_batch=40")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "megatron-rl: config error: trainer.max_tokens_per_micro_batch=40 is smaller than trainer.seq_length=48, "
        "the longest sequence a micro-batch must hold"
    ]


def test_disaggregated_rollouts_leave_a_training_world_the_layouts_fit():
    """rollout.placement=disaggregated: the layouts get the launch minus rollout.num_ranks."""
    disagg = ["rollout.placement=disaggregated", "rollout.num_ranks=2", "eval.sets={}"]  # eval runs colocated
    validate(load_config(DAPO, [*disagg, "parallel.expert_model_parallel_size=2"]), 4)  # EP2 on 2 training ranks
    with pytest.raises(ConfigError, match=r"parallel: .*world.* 2"):  # EP4 needs 4 training ranks
        validate(load_config(DAPO, [*disagg, "parallel.expert_model_parallel_size=4"]), 4)
    with pytest.raises(
        ConfigError,
        match=r"rollout.num_ranks=4 leaves no training rank in a launch of 4; "
        r"allowed: 1..3",
    ):
        validate(load_config(DAPO, ["rollout.placement=disaggregated", "rollout.num_ranks=4"]), 4)
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size=2 must divide the 3 ranks that run vLLM"):
        validate(
            load_config(
                DAPO, ["rollout.placement=disaggregated", "rollout.num_ranks=3", "rollout.tensor_parallel_size=2"]
            ),
            4,
        )
    tppo = ["algorithm.recipe=tppo", "algorithm.overrides={generation_window: 4}"]
    validate(load_config(DAPO, [*disagg, *tppo]), 4)  # windows continue on the rollout ranks
    with pytest.raises(ConfigError, match="rollout.max_staleness=1 cannot be combined with generation_window"):
        validate(load_config(DAPO, [*disagg, *tppo, "rollout.max_staleness=1"]), 4)


def test_placement_and_rollout_ranks_are_checked_in_one_line():
    with pytest.raises(
        ConfigError,
        match=r"rollout.placement='split' is not allowed; choose one of "
        r"\['colocated', 'disaggregated'\]",
    ):
        load_config(DAPO, ["rollout.placement=split"])
    with pytest.raises(ConfigError, match="rollout.num_ranks=2 only applies to rollout.placement=disaggregated"):
        load_config(DAPO, ["rollout.num_ranks=2"])
    with pytest.raises(ConfigError, match="placement=disaggregated needs >= 1 rank for vLLM"):
        load_config(DAPO, ["rollout.placement=disaggregated"])


def test_rollouts_ahead_need_their_own_ranks_and_a_rollout_correction():
    with pytest.raises(ConfigError, match="rollout.max_staleness=1 needs rollout.placement=disaggregated"):
        load_config(DAPO, ["rollout.max_staleness=1"])
    with pytest.raises(ConfigError, match="rollout.max_staleness=-1 must be >= 0"):
        load_config(DAPO, ["rollout.max_staleness=-1"])
    ahead = ["rollout.placement=disaggregated", "rollout.num_ranks=1", "rollout.max_staleness=1", "eval.sets={}"]
    with pytest.raises(
        ConfigError,
        match=r"rollout.max_staleness=1 trains on samples of an older policy: "
        r"set algorithm.overrides.rollout_correction",
    ):
        validate(load_config(DAPO, ahead), 2)
    validate(load_config(DAPO, [*ahead, "algorithm.overrides={rollout_correction: {kind: token_tis, cap: 2.0}}"]), 2)


def test_partial_rollouts_need_rollouts_running_ahead_on_their_own_ranks():
    needs = "rollout.partial=true needs rollout.placement=disaggregated and rollout.max_staleness >= 1"
    with pytest.raises(ConfigError, match=needs + r" \(got colocated, 0\)"):
        load_config(DAPO, ["rollout.partial=true"])
    disagg = ["rollout.placement=disaggregated", "rollout.num_ranks=1", "eval.sets={}"]  # eval runs colocated
    with pytest.raises(ConfigError, match=needs + r" \(got disaggregated, 0\)"):
        load_config(DAPO, [*disagg, "rollout.partial=true"])
    ahead = [
        *disagg,
        "rollout.max_staleness=1",
        "rollout.partial=true",
        "algorithm.overrides={rollout_correction: {kind: token_tis, cap: 2.0}}",
    ]
    with pytest.raises(ConfigError, match="rollout.partial_chunk_tokens=0 must be >= 1"):
        load_config(DAPO, [*ahead, "rollout.partial_chunk_tokens=0"])
    validate(load_config(DAPO, ahead), 2)


def test_the_local_dispatcher_is_refused_where_experts_span_ranks():
    validate(load_config(DAPO, ["model.moe_token_dispatcher_type=local"]), 2)  # EP1, DP2
    with pytest.raises(
        ConfigError,
        match="moe_token_dispatcher_type=local keeps every expert on each rank, but parallel has "
        "expert_model_parallel_size=2, expert_tensor_parallel_size=1; use alltoall or allgather",
    ):
        validate(
            load_config(DAPO, ["model.moe_token_dispatcher_type=local", "parallel.expert_model_parallel_size=2"]), 2
        )
    with pytest.raises(ConfigError, match="moe_token_dispatcher_type='flex' is not allowed"):
        load_config(DAPO, ["model.moe_token_dispatcher_type=flex"])


def test_a_moe_models_adapters_cannot_sync_alone_into_vllm():
    cfg = load_config(EXAMPLES / "dapo_lora.yaml", ["model.lora.sync=adapter", "model.lora.targets=[qkv, proj]"])
    with pytest.raises(ConfigError, match="model.lora.sync=adapter needs a dense model"):
        validate(cfg, 1)
    validate(load_config(EXAMPLES / "dapo_lora.yaml", ["model.lora.sync=adapter", "model.preset=tiny-dense"]), 1)


def test_the_lora_example_is_the_embedded_default_with_adapters():
    lora, default = load_config(EXAMPLES / "dapo_lora.yaml", []), load_config(DAPO, [])
    validate(lora, 1)
    assert (lora.model.lora.rank, lora.model.lora.alpha, lora.trainer.lr) == (8, 64.0, 0.002)
    lora.model.lora, lora.trainer.lr, lora.trainer.run_dir = None, default.trainer.lr, default.trainer.run_dir
    assert lora == default
