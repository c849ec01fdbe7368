"""Where a run's model and prompts come from, derived from the config without torch.

Validation and the trainer both ask these functions, so the model a layout is checked
against is the one the trainer builds:

- ``model.hf_path`` set: its config.json (prompts: ``data.source``, or for ``task:<name>``
  data the directory's ``train.jsonl``, as a built task base holds it).
- RL on ``task:<name>`` without hf_path: the task's supervised base of the architecture
  ``model.preset`` names (:func:`base_settings`), built by the trainer.
- ``trainer.job=smoke`` without hf_path: the architecture ``model.preset`` names
  (models.presets), which the smoke job builds.
- RL on ``reasoning_gym:<dataset>`` data: prompts from reasoning-gym (:func:`gym_spec`);
  without hf_path the trainer builds the dataset's tiny base (``tasks.gym_base``).
- RL on a prompt file without hf_path: no model to start from, a :class:`ConfigError`.
- A reward model on ``pairs:task:<name>``: the task's base, as for RL on ``task:<name>``;
  on a ``pairs:PATH`` file it needs hf_path (:func:`pairs_file`).
"""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path
from typing import Optional

from megatron_rl.config.schema import PAIRS_PREFIX, TASK_PREFIX, Config, ConfigError
from megatron_rl.data.reasoning_gym import SOURCE_PREFIX as GYM_PREFIX
from megatron_rl.data.reasoning_gym import GymSpec
from megatron_rl.models.hf_config import ModelArch, arch_from_hf
from megatron_rl.models.presets import PRESETS
from megatron_rl.parallel.config import ModelShape
from megatron_rl.tasks.base_model import HELD_OUT_FILE, TASK_BASE_SETTINGS, BaseBuild, BaseModelSettings
from megatron_rl.tasks.digits import get_task
from megatron_rl.tasks.gym_base import WARMUP_CORRECT_FRACTION, GymBaseSettings
from megatron_rl.tasks.tool_products import TOOL_TASKS, ToolBaseSettings

GYM_REWARD = "reasoning_gym"
"""The reward of reasoning-gym prompts (data and eval sets): the dataset's own score_answer."""


def task_name(config: Config) -> Optional[str]:
    """The task of ``task:<name>`` data (and of ``pairs:task:<name>``, whose base and pairs
    come from the task), None for a prompt or pairs file."""
    source = config.data.source
    if source.startswith(PAIRS_PREFIX):
        source = source[len(PAIRS_PREFIX) :]
    return source[len(TASK_PREFIX) :] if source.startswith(TASK_PREFIX) else None


def pairs_source(config: Config) -> Optional[str]:
    """What follows ``pairs:`` in data.source (a file, or task:<name>); None for other data."""
    source = config.data.source
    return source[len(PAIRS_PREFIX) :] if source.startswith(PAIRS_PREFIX) else None


def pairs_file(config: Config) -> Optional[Path]:
    """The preference-pairs file of ``pairs:PATH`` data; None for ``pairs:task:<name>`` (the
    run writes the task's pairs) and for other data."""
    source = pairs_source(config)
    if source is None or source.startswith(TASK_PREFIX):
        return None
    return Path(source)


def gym_spec(config: Config) -> Optional[GymSpec]:
    """The training set of ``reasoning_gym:<dataset>`` data (not yet checked against
    reasoning-gym: the validation pass does that); None for other sources."""
    data = config.data
    if not data.source.startswith(GYM_PREFIX):
        return None
    seed = base_seed(config)
    return GymSpec(data.source[len(GYM_PREFIX) :], dict(data.options), seed, data.size)


def verifier_name(config: Config) -> str:
    """The run's reward (rewards.REWARDS): data.reward, or for auto the source's own."""
    if config.data.reward != "auto":
        return config.data.reward
    if gym_spec(config) is not None:
        return GYM_REWARD
    name = task_name(config)
    if name is None:
        return "math"
    return "digits" if name in TOOL_TASKS else get_task(name).verifier


def base_settings(config: Config) -> Optional[BaseBuild]:
    """The base the RL trainer builds and starts from (a task's :class:`BaseModelSettings`, or
    a reasoning-gym dataset's ``GymBaseSettings``); None when it starts from model.hf_path.
    A prompt file without hf_path is refused: the base's tokenizer and warm-up come from a
    task, so no base exists for arbitrary prompts."""
    if config.model.hf_path is not None:
        return None
    spec = gym_spec(config)
    if spec is not None:
        try:
            model = BaseModelSettings.from_arch(
                PRESETS[config.model.preset], seed=base_seed(config), warmup_correct_fraction=WARMUP_CORRECT_FRACTION
            )
        except ValueError as err:
            raise ConfigError(f"model.preset={config.model.preset!r}: {err}") from None
        return GymBaseSettings(model=model, spec=spec)
    name = task_name(config)
    if name is None:
        raise ConfigError(
            f"model.hf_path must be set when data.source is a file ({config.data.source}); "
            f"model.preset={config.model.preset!r} builds a base only for task:<name> data"
        )
    if name in TOOL_TASKS:
        return ToolBaseSettings(model=_from_preset(config, warmup_steps=TOOL_WARMUP_STEPS))
    try:
        get_task(name)
    except ValueError as err:  # an unknown task lists the valid ones
        raise ConfigError(f"data.source={config.data.source!r}: {err}") from None
    return _from_preset(config, task=name, **TASK_BASE_SETTINGS.get(name, {}))


TOOL_WARMUP_STEPS = 800
"""The tool task's warm-up: copying numbers into a call and out of its output takes the
2-layer base more steps than the digit tasks' answer format."""


def base_seed(config: Config) -> int:
    """The seed a built base (its prompts, tokenizer, initial weights and warm-up) comes from:
    ``data.seed``, else ``trainer.seed``. Runs that differ only in ``trainer.seed`` and share
    ``data.seed`` start from one base and sample, shuffle and update differently: the seeds of
    a multi-seed comparison (``megatron-rl bench compare``)."""
    return config.trainer.seed if config.data.seed is None else config.data.seed


def _from_preset(config: Config, **settings) -> BaseModelSettings:
    try:
        return BaseModelSettings.from_arch(PRESETS[config.model.preset], seed=base_seed(config), **settings)
    except ValueError as err:
        raise ConfigError(f"model.preset={config.model.preset!r}: {err}") from None


def model_arch(config: Config) -> ModelArch:
    """The architecture of model.hf_path, or the smoke job's preset. The RL task base has no
    architecture before it is built (its vocabulary comes from the trained tokenizer): use
    :func:`model_shape` to check layouts against it."""
    if config.model.hf_path is not None:
        cfg_file = Path(config.model.hf_path) / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"model.hf_path={config.model.hf_path}: no config.json there")
        try:
            return arch_from_hf(types.SimpleNamespace(**json.loads(cfg_file.read_text())))
        except AttributeError as err:
            raise ConfigError(f"model.hf_path={config.model.hf_path}: config.json has no {err.name!r}") from None
        except ValueError as err:  # not JSON, an unsupported family
            raise ConfigError(f"model.hf_path={config.model.hf_path}: config.json: {err}") from None
    if config.trainer.job != "smoke":
        raise ValueError("the RL task base has no architecture before it is built; use model_shape(config)")
    return PRESETS[config.model.preset]


TASK_TEACHER = "task"
"""``algorithm.teacher.path`` that has the run build its task's teacher (:func:`teacher_settings`)."""
TEACHER_SHAPE = dict(
    family="qwen3", hidden_size=256, num_layers=4, num_attention_heads=8, num_key_value_heads=4, intermediate_size=512
)
"""The task teacher: a dense model about ten times the tiny bases' size."""
TEACHER_WARMUP = dict(warmup_correct_fraction=1.0, warmup_steps=300)
"""The task teacher's warm-up: true answers only, long enough to answer most prompts right."""


def teacher_settings(config: Config) -> BaseModelSettings:
    """The teacher a ``task:<name>`` run builds for ``algorithm.teacher.path=task``: the
    student's task base settings (the same task, corpus and seed, so the same tokenizer and
    chat template) at :data:`TEACHER_SHAPE`, warmed up on true answers."""
    settings = base_settings(config) if config.model.hf_path is None else None
    if not isinstance(settings, BaseModelSettings):
        raise ConfigError(
            f"algorithm.teacher.path={TASK_TEACHER} builds the task's teacher: it needs data.source=task:<name> of a "
            "digit task without model.hf_path; give the teacher's HF directory otherwise"
        )
    return dataclasses.replace(settings, **TEACHER_SHAPE, **TEACHER_WARMUP)


def model_shape(config: Config) -> ModelShape:
    """What a parallel layout must divide, for the model this run's job builds."""
    if config.trainer.job == "rl" and config.model.hf_path is None:
        return base_settings(config).model_shape()
    return model_arch(config).shape()


def prompt_file(config: Config) -> Optional[Path]:
    """The prompt file an RL run reads that must exist before it starts; None when the
    trainer writes it (the task base's ``train.jsonl``) or reasoning-gym generates the prompts."""
    if gym_spec(config) is not None:
        return None
    if task_name(config) is None:
        return Path(config.data.source)
    if config.model.hf_path is not None:
        return Path(config.model.hf_path) / "train.jsonl"
    return None


def held_out_file(config: Config) -> Optional[Path]:
    """The held-out split of task:<name> data that must exist before the run starts (in
    model.hf_path); None when the trainer writes it with the task base."""
    if task_name(config) is None:
        raise ValueError("a held-out split exists only for task:<name> data")
    if config.model.hf_path is not None:
        return Path(config.model.hf_path) / HELD_OUT_FILE
    return None
