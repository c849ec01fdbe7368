"""The checks of ``reward.scorers`` (config/reward.py) that need more than the section itself.

Before any model is built: every rule names a known verifier, every model scorer names a
committed reward-model checkpoint whose architecture the actor's layout can hold (when it
runs there), and (once the policy's base directory exists, :func:`check_scorer_tokenizers`)
reads text with the policy's own tokenizer and chat template: a model scorer reads the
policy's token ids as they are, so a reward model of another tokenizer would score other
text than the one generated. Each problem is one ConfigError line naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from megatron_rl.config.reward import BASE, JUDGE, MODEL, RULE, VLLM, ScorerConfig
from megatron_rl.config.schema import MODEL_ROLE, REWARD_MODEL, Config, ConfigError
from megatron_rl.models.hf_config import ModelArch, arch_from_dict
from megatron_rl.parallel.config import LayoutError
from megatron_rl.rewards.registry import REWARDS

CHECKPOINTS = "checkpoints"
"""A run directory's checkpoints, where a model scorer's ``path`` may point instead."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
"""The files whose contents make a tokenizer and its chat template."""


def reward_model_root(path: str | Path) -> Path:
    """The checkpoints directory of a model scorer's ``path`` (a run directory or the checkpoints itself)."""
    path = Path(path)
    return path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path


def check_scorers(config: Config, world_size: int) -> None:
    """reward.scorers against the run (world_size: the ranks that train)."""
    scorers = config.reward.scorers
    if not scorers:
        return
    if config.environment.episodes:
        raise ConfigError(
            f"reward.scorers: environment.name={config.environment.name!r} episodes are scored by their "
            "environment; reward.scorers applies to single_turn runs"
        )
    for name, scorer in scorers.items():
        where = f"reward.scorers.{name}"
        if scorer.kind == RULE:
            _check_rule(where, scorer)
        elif scorer.kind == MODEL:
            check_model_scorer(where, scorer, config, world_size)
        elif scorer.kind == JUDGE:
            _check_judge_dir(where, scorer)


def _check_rule(where: str, scorer: ScorerConfig) -> None:
    if scorer.reward != "auto" and scorer.reward not in REWARDS:
        raise ConfigError(
            f"{where}.reward={scorer.reward!r} is not allowed; choose one of {sorted(['auto', *REWARDS])}"
        )


def _check_judge_dir(where: str, scorer: ScorerConfig) -> None:
    """A judge's HF directory holds a model and its tokenizer (``base``: the run's own, built later)."""
    if scorer.path == BASE:
        return
    path = Path(scorer.path)
    missing = [f for f in ("config.json", "tokenizer_config.json") if not (path / f).is_file()]
    if missing:
        raise ConfigError(
            f"{where}.path={scorer.path!r} has no {missing[0]}: a judge is an HF model directory with its "
            f"tokenizer, or {BASE} for the run's base"
        )


def reward_model_extra(where: str, scorer: ScorerConfig) -> dict:
    """The ``extra`` of the reward model's checkpoint the scorer loads, checked to be one."""
    # Imported here, not above: checkpoint.format imports torch, and a config without a
    # model scorer is checked without it (from_config.checks: the cheap checks import no torch).
    from megatron_rl.checkpoint import format as fmt

    root = reward_model_root(scorer.path)
    try:
        step = fmt.resolve_step(root, scorer.step)
        extra = fmt.read_metadata(root, step).extra
    except fmt.CheckpointError as err:
        raise ConfigError(f"{where}.path={scorer.path!r}: {err}") from None
    if extra.get(MODEL_ROLE) != REWARD_MODEL:
        raise ConfigError(
            f"{where}.path={scorer.path!r}: step {step} of {root} is not a reward model (it was not trained "
            f"by algorithm.recipe={REWARD_MODEL}); a model scorer reads a reward model's checkpoints"
        )
    if not extra.get("hf_config"):
        raise ConfigError(f"{where}.path={scorer.path!r}: step {step} records no hf_config, so its model is unknown")
    return extra


def reward_model_arch(where: str, scorer: ScorerConfig) -> ModelArch:
    """The architecture of the reward model the scorer loads (from its checkpoint's config)."""
    return arch_from_dict(reward_model_extra(where, scorer)["hf_config"])


def check_model_scorer(where: str, scorer: ScorerConfig, config: Config, world_size: int) -> None:
    """A committed reward-model checkpoint whose model the actor's layout can hold (on
    engine megatron; on vllm its own engine holds it whole)."""
    if scorer.engine == VLLM:
        reward_model_extra(where, scorer)
        return
    try:
        config.parallel.validate(world_size, reward_model_arch(where, scorer).shape())
    except LayoutError as err:
        raise ConfigError(
            f"{where}: the reward model runs in the actor's layout (parallel), which cannot hold it: {err}"
        ) from None


def check_scorer_tokenizers(config: Config, policy_dir: Path) -> None:
    """Every model scorer's reward model tokenizes as the policy does (same tokenizer files)."""
    for name, scorer in config.reward.scorers.items():
        if scorer.kind != MODEL:
            continue
        where = f"reward.scorers.{name}"
        source = reward_model_extra(where, scorer).get("hf_source_dir")
        differs = tokenizer_difference(Path(source), policy_dir) if source else "its checkpoint records no base"
        if differs:
            raise ConfigError(
                f"{where}: the reward model cannot score the policy's text: {differs}; a model scorer reads the "
                "policy's token ids, so it needs a reward model trained from the policy's tokenizer and chat template"
            )


def tokenizer_difference(rm_dir: Path, policy_dir: Path) -> Optional[str]:
    """Why the two directories' tokenizers differ (the first differing file), or None."""
    for file in TOKENIZER_FILES:
        a, b = _read(rm_dir / file), _read(policy_dir / file)
        if a != b:
            return f"its {file} ({rm_dir}) differs from the policy's ({policy_dir})"
    return None


def _read(path: Path) -> Optional[object]:
    if not path.is_file():
        return None
    text = path.read_text()
    try:
        return json.loads(text)
    except ValueError:
        return text
