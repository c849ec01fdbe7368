"""A run's episodes as plain values, and the driver built from them on the rank that runs them.

The training ranks build an :class:`EpisodeSpec` from the config. Where vLLM is colocated,
each rank builds its driver from it; where the engines live on rollout ranks of their own,
the spec travels to them in a ``StartEpisodes`` command (:mod:`megatron_rl.environments.served`)
and they build it there, so the tools run beside the engine that generates the turns (and
beside nothing that trains).
"""

from __future__ import annotations

import dataclasses

from megatron_rl.environments.driver import DriverConfig, EpisodeDriver
from megatron_rl.environments.sandbox import SandboxConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeSpec:
    """The environment, its tools and how episodes are sampled and bounded (all picklable)."""

    environment: str
    """By name (``environments.registry.ENVIRONMENTS``)."""
    reward: str
    """The reward function scoring a final answer, by name."""
    tools: tuple[str, ...]
    sandbox: SandboxConfig
    parser: str
    driver: DriverConfig


def build_driver(spec: EpisodeSpec, engine, tokenizer, announce: bool = True) -> EpisodeDriver:
    """The environment (tools in their sandbox, checked against this machine's isolation,
    which ``announce`` prints in one line) and its driver on ``engine``."""
    from megatron_rl.environments.interface import EnvironmentSetup
    from megatron_rl.environments.isolation import probe_isolation
    from megatron_rl.environments.registry import get_environment
    from megatron_rl.environments.tools import build_tools

    report = probe_isolation()
    if announce:
        print(report.line(), flush=True)
    tools, runner = build_tools(spec.tools, spec.sandbox, report)
    setup = EnvironmentSetup(reward=spec.reward, tools=tools, tool_runner=runner, tool_parser=spec.parser)
    return EpisodeDriver(engine, tokenizer, get_environment(spec.environment, setup), spec.driver)
