"""algorithm.teacher against the recipe and the run (from_config.teacher_checks): a recipe
that distills needs a teacher and a teacher needs such a recipe; a teacher directory holds
a model whose shape the actor's layout divides; ``task`` builds the task's teacher for task
data only; a teacher of another tokenizer is refused. Each failure one line."""

import json
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.from_config import validate
from megatron_rl.from_config.sources import teacher_settings
from megatron_rl.from_config.teacher_checks import check_teacher_tokenizer
from megatron_rl.tasks.base_model import BaseModelSettings

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
OPD, GRPO = str(EXAMPLES / "opd.yaml"), str(EXAMPLES / "grpo.yaml")


def _fails(path, overrides, message, world=1):
    with pytest.raises(ConfigError) as err:
        validate(load_config(path, overrides), world)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_recipe_and_the_teacher_go_together(tmp_path):
    _fails(OPD, ["algorithm.teacher=null"], "distills (distill_coef=1.0): it needs algorithm.teacher={path: HF_DIR}")
    _fails(GRPO, ["algorithm.teacher={path: task}"], "algorithm.teacher applies to recipes that distill")
    _fails(OPD, [f"algorithm.teacher.path={tmp_path}"], "has no config.json: a teacher is an HF model directory")
    _fails(OPD, ["algorithm.overrides={distill_coef: 0}"], "distill_coef=0")  # estimator none needs the term
    validate(load_config(GRPO, ["algorithm.teacher={path: task}", "algorithm.overrides={distill_coef: 0.5}"]), 1)


def test_a_teacher_the_layout_cannot_hold_is_refused(tmp_path):
    teacher = BaseModelSettings(family="qwen3", num_attention_heads=3, num_key_value_heads=3, head_dim=32)
    (tmp_path / "config.json").write_text(json.dumps(teacher.hf_fields(384)))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    _fails(
        OPD,
        [f"algorithm.teacher.path={tmp_path}", "parallel.tensor_model_parallel_size=2"],
        "algorithm.teacher: the teacher runs in the actor's layout (parallel), which cannot hold it",
        world=2,
    )


def test_the_task_teacher_is_the_students_task_at_ten_times_the_size():
    cfg = load_config(OPD, [])
    teacher = teacher_settings(cfg)
    assert (teacher.task, teacher.seed, teacher.tokenizer_vocab_size) == ("digits_max", 1234, 320)
    assert (teacher.hidden_size, teacher.num_layers, teacher.warmup_correct_fraction) == (256, 4, 1.0)
    with pytest.raises(
        ConfigError, match="algorithm.teacher.path=task builds the task's teacher: it needs data.source"
    ):
        teacher_settings(load_config(OPD, ["model.hf_path=/some/model"]))


def test_a_teacher_of_another_tokenizer_is_refused(tmp_path):
    student, teacher = tmp_path / "student", tmp_path / "teacher"
    for d, vocab in ((student, {"a": 0}), (teacher, {"b": 0})):
        d.mkdir()
        (d / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    with pytest.raises(ConfigError, match="the teacher cannot score the student's tokens: its tokenizer.json"):
        check_teacher_tokenizer(teacher, student)
    check_teacher_tokenizer(student, student)
