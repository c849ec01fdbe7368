"""The spec of a `megatron-rl bench compare`: which recipe, which seeds, which variants.

A YAML mapping (every key but ``name``, ``config``, ``seeds`` and ``variants`` optional)::

    name: tppo_vs_ppo
    config: examples/ppo.yaml             # the base recipe (relative to the current directory)
    overrides: [data.source=task:digits_sum_work, trainer.max_steps=100]   # every run
    seeds: [1, 2, 3]                      # trainer.seed of each run
    variants:                             # name -> its overrides; the first is the baseline
      ppo: []
      tppo: [algorithm.recipe=tppo, "algorithm.overrides={generation_window: 8}"]
    base_seed: 0                          # data.seed of every run (null: not passed)
    target: {metric: reward/mean, value: 0.3, smooth: 5}   # time and steps to reach it
    last: 10                              # steps in the "last K steps" and "best K steps" means
    metrics: [reward/mean, val/*/accuracy, actor/entropy, response_length/mean, rollout/truncated]
    grid_points: 50                       # points of the equal-wall-clock grid

``base_seed`` makes the runs of one comparison start from one base: the trainer builds a
task's base from ``data.seed`` (``trainer.seed`` when it is null), so without it each
seed would also draw another base, and a seed's spread would mix the two. The harness
sets ``trainer.seed``, ``trainer.run_dir`` and ``data.seed`` itself; an override of any of
them is refused. A bad spec is one :class:`SpecError` line naming the key and what it
accepts; nothing runs.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Optional

import yaml

DEFAULT_METRICS = ("reward/mean", "val/*/accuracy", "actor/entropy", "response_length/mean", "rollout/truncated")
"""What a comparison draws and compares when the spec names no metrics (``*``: any set)."""
HARNESS_KEYS = ("trainer.seed", "trainer.run_dir", "data.seed")
"""Config keys the harness sets for each run; a spec override of one is refused."""
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
"""Variant names become directory names."""
REQUIRED = ("name", "config", "seeds", "variants")
OPTIONAL = ("overrides", "base_seed", "target", "last", "metrics", "grid_points")
TARGET_KEYS = ("metric", "value", "smooth")


class SpecError(ValueError):
    """A spec that cannot run; the message names the key and what is allowed."""


@dataclasses.dataclass(frozen=True)
class Target:
    """Reached at the first step where the trailing mean of ``metric`` over ``smooth`` steps
    is >= ``value``."""

    metric: str
    value: float
    smooth: int = 1


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str
    config: str
    seeds: tuple[int, ...]
    variants: dict[str, tuple[str, ...]]
    """In the spec's order; the first is the baseline the others are compared with."""
    overrides: tuple[str, ...] = ()
    base_seed: Optional[int] = 0
    target: Optional[Target] = None
    last: int = 10
    metrics: tuple[str, ...] = DEFAULT_METRICS
    grid_points: int = 50

    @property
    def baseline(self) -> str:
        return next(iter(self.variants))

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["variants"] = {name: list(o) for name, o in self.variants.items()}
        return out


def load_spec(path: Path) -> Spec:
    """Read and check a spec file (:class:`SpecError` on anything wrong)."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: no such spec file")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise SpecError(f"{path}: not YAML ({str(err).splitlines()[0]})") from None
    try:
        return parse_spec(raw)
    except SpecError as err:
        raise SpecError(f"{path}: {err}") from None


def parse_spec(raw: object) -> Spec:
    """A :class:`Spec` from the YAML's mapping, every key checked."""
    if not isinstance(raw, dict):
        raise SpecError(f"expected a mapping with keys {', '.join(REQUIRED)}, got {type(raw).__name__}")
    unknown = [k for k in raw if k not in REQUIRED + OPTIONAL]
    if unknown:
        raise SpecError(f"unknown key {unknown[0]!r}; allowed: {', '.join(REQUIRED + OPTIONAL)}")
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise SpecError(f"missing key {missing[0]!r} (required: {', '.join(REQUIRED)})")
    if not isinstance(raw["name"], str) or not NAME.match(raw["name"]):
        raise SpecError(f"name: expected a word of letters, digits, '_', '.', '-', got {raw['name']!r}")
    if not isinstance(raw["config"], str) or not raw["config"]:
        raise SpecError(f"config: expected the path of a recipe YAML, got {raw['config']!r}")
    return Spec(
        name=raw["name"],
        config=raw["config"],
        seeds=_seeds(raw["seeds"]),
        variants=_variants(raw["variants"]),
        overrides=_overrides("overrides", raw.get("overrides", [])),
        base_seed=_optional_int("base_seed", raw.get("base_seed", 0)),
        target=_target(raw.get("target")),
        last=_positive("last", raw.get("last", 10)),
        metrics=_metrics(raw.get("metrics", list(DEFAULT_METRICS))),
        grid_points=_positive("grid_points", raw.get("grid_points", 50), minimum=2),
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _seeds(value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(map(_is_int, value)) or len(set(value)) != len(value):
        raise SpecError(f"seeds: expected a non-empty list of distinct integers, got {value!r}")
    return tuple(value)


def _overrides(key: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(o, str) and "=" in o for o in value):
        raise SpecError(f"{key}: expected a list of 'key=value' config overrides, got {value!r}")
    for override in value:
        if override.split("=", 1)[0].strip() in HARNESS_KEYS:
            raise SpecError(
                f"{key}: {override!r} sets a key the harness sets per run ({', '.join(HARNESS_KEYS)}); "
                "use seeds and base_seed"
            )
    return tuple(value)


def _variants(value: object) -> dict[str, tuple[str, ...]]:
    if not isinstance(value, dict) or not value:
        raise SpecError(f"variants: expected a mapping of variant name -> list of overrides, got {value!r}")
    out = {}
    for name, overrides in value.items():
        if not isinstance(name, str) or not NAME.match(name):
            raise SpecError(f"variants: name {name!r} must be a word of letters, digits, '_', '.', '-'")
        out[name] = _overrides(f"variants.{name}", [] if overrides is None else overrides)
    return out


def _optional_int(key: str, value: object) -> Optional[int]:
    if value is not None and not _is_int(value):
        raise SpecError(f"{key}: expected an integer or null, got {value!r}")
    return value


def _positive(key: str, value: object, minimum: int = 1) -> int:
    if not _is_int(value) or value < minimum:
        raise SpecError(f"{key}: expected an integer >= {minimum}, got {value!r}")
    return value


def _target(value: object) -> Optional[Target]:
    if value is None:
        return None
    if not isinstance(value, dict) or any(k not in TARGET_KEYS for k in value) or "metric" not in value:
        raise SpecError(f"target: expected a mapping with keys {', '.join(TARGET_KEYS)}, got {value!r}")
    if not isinstance(value["metric"], str) or "*" in value["metric"]:
        raise SpecError(f"target.metric: expected one metric name, got {value['metric']!r}")
    number = value.get("value")
    if not isinstance(number, (int, float)) or isinstance(number, bool):
        raise SpecError(f"target.value: expected a number, got {number!r}")
    return Target(value["metric"], float(number), _positive("target.smooth", value.get("smooth", 1)))


def _metrics(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(m, str) and m for m in value):
        raise SpecError(f"metrics: expected a non-empty list of metric names ('*' matches a part), got {value!r}")
    return tuple(value)
