"""On-policy distillation's teacher (``algorithm.teacher``) against the run, before any model is built.

A recipe with ``distill_coef > 0`` needs a teacher and a teacher needs such a recipe; the
teacher's directory holds an HF model and its tokenizer (or ``task``: the run builds its
task's teacher, from_config.sources.teacher_settings), its shape fits the actor's layout
(it runs frozen beside the actor), and (once the student's base directory exists,
:func:`check_teacher_tokenizer`) it reads text with the student's own tokenizer and chat
template: the teacher scores the student's token ids as they are, so a teacher of another
tokenizer would score other text (a vocabulary that does not cover the student's among it).
Each problem is one ConfigError line naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_rl.config.schema import Config, ConfigError
from megatron_rl.from_config.scorer_checks import tokenizer_difference
from megatron_rl.from_config.sources import TASK_TEACHER, teacher_settings
from megatron_rl.models.hf_config import arch_from_dict
from megatron_rl.parallel.config import LayoutError

WHERE = "algorithm.teacher"


def check_teacher(config: Config, recipe, world_size: int) -> None:
    """The teacher and the recipe's distill_coef agree; the teacher's directory holds a model
    the actor's layout can hold (``recipe``: the built AlgorithmRecipe)."""
    teacher = config.algorithm.teacher
    distills = recipe.distill_coef > 0
    if distills and teacher is None:
        raise ConfigError(
            f"algorithm.recipe={config.algorithm.recipe} distills (distill_coef={recipe.distill_coef}): it needs "
            f"{WHERE}={{path: HF_DIR}}, the teacher that scores each sampled token"
        )
    if teacher is None:
        return
    if not distills:
        raise ConfigError(
            f"{WHERE} applies to recipes that distill (distill_coef > 0: opd, or algorithm.overrides="
            f"{{distill_coef: ...}}); algorithm.recipe={config.algorithm.recipe} has distill_coef=0"
        )
    if teacher.path == TASK_TEACHER:
        shape = teacher_settings(config).model_shape()  # built by the run, after these checks
    else:
        path = Path(teacher.path)
        missing = [f for f in ("config.json", "tokenizer_config.json") if not (path / f).is_file()]
        if missing:
            raise ConfigError(
                f"{WHERE}.path={teacher.path!r} has no {missing[0]}: a teacher is an HF model directory, or "
                f"{TASK_TEACHER} for the task's own (task:<name> data)"
            )
        shape = arch_from_dict(json.loads((path / "config.json").read_text())).shape()
    try:
        config.parallel.validate(world_size, shape)
    except LayoutError as err:
        raise ConfigError(
            f"{WHERE}: the teacher runs in the actor's layout (parallel), which cannot hold it: {err}"
        ) from None


def check_teacher_tokenizer(teacher_dir: Path, student_dir: Path) -> None:
    """The teacher tokenizes as the student does (the same tokenizer files)."""
    differs = tokenizer_difference(teacher_dir, student_dir)
    if differs:
        raise ConfigError(
            f"{WHERE}: the teacher cannot score the student's tokens: {differs}; on-policy distillation reads the "
            "student's token ids, so the teacher needs the student's tokenizer and chat template"
        )
