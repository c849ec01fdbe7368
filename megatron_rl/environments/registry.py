"""Environments by name. Every entry is built from one :class:`EnvironmentSetup`."""

from __future__ import annotations

from typing import Callable

from megatron_rl.environments.interface import Environment, EnvironmentSetup
from megatron_rl.environments.single_turn import SingleTurn
from megatron_rl.environments.tool_use import ToolUse

ENVIRONMENTS: dict[str, Callable[[EnvironmentSetup], Environment]] = {
    "single_turn": SingleTurn,
    "tools": ToolUse,
}


def get_environment(name: str, setup: EnvironmentSetup) -> Environment:
    if name not in ENVIRONMENTS:
        raise ValueError(f"environment {name!r} is not known; allowed: {sorted(ENVIRONMENTS)}")
    return ENVIRONMENTS[name](setup)
