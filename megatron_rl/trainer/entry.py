"""The entry point of an RL launch: what ``megatron-rl train`` runs on every rank.

:func:`train` installs the stop signals first (a signal during start-up is not fatal
either), splits a disaggregated launch into training and rollout ranks and runs each
role: the training ranks an :class:`~megatron_rl.trainer.trainer.RLTrainer`, the rollout
ranks the rollout server. ``algorithm.recipe=reward_model`` runs the reward model's trainer
(:mod:`megatron_rl.trainer.reward_model`) on every rank instead, ``sft`` supervised
fine-tuning (:mod:`megatron_rl.trainer.sft`). A training rank whose
rollout ranks failed leaves at once (:func:`_exit_now`); how a run's exit code is chosen
is :mod:`megatron_rl.trainer.ending`.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from megatron_rl.config import Config
from megatron_rl.config.schema import SFT
from megatron_rl.environments.served import EpisodeService
from megatron_rl.launch import exit_codes, startup_gc
from megatron_rl.launch.exclude import ExcludeWatch
from megatron_rl.launch.roles import ROLLOUT, RoleWorld, init_roles
from megatron_rl.launch.signals import StopSignals
from megatron_rl.rollout.client import RolloutRankError
from megatron_rl.rollout.server import serve
from megatron_rl.trainer.reward_model import reward_model_trainer
from megatron_rl.trainer.sft import sft_trainer
from megatron_rl.trainer.trainer import RLTrainer


def train(cfg: Config) -> dict:
    """Run ``trainer.max_steps`` RL steps (or, for ``algorithm.recipe=reward_model``, reward-model
    steps: trainer.reward_model); returns a summary (rank 0 writes the run dir).

    SIGUSR1 / SIGTERM / SIGINT (Slurm preemption, scancel, Ctrl-C) stop the run after the current step with
    a committed checkpoint; the summary's ``exit_code`` then says "requeue me" (launch.exit_codes).
    With disaggregated rollouts the launch is split first; its rollout ranks serve the
    training ranks' commands until the run ends (the training ranks decide when to stop)."""
    with StopSignals(exclude=ExcludeWatch.in_job(cfg.trainer.run_dir)) as stop:
        if cfg.algorithm.trains_reward_model:  # no policy, no rollouts: pairs in, a scalar model out
            return reward_model_trainer(cfg, stop).run()
        if cfg.algorithm.recipe == SFT:  # no rollouts: conversations in, a policy out
            return sft_trainer(cfg, stop).run()
        if cfg.rollout.placement != "disaggregated":
            return RLTrainer(cfg, stop).run()
        # Training ranks other than 0 wait in a broadcast of the training world for each answer.
        longest_answer_s = max(cfg.rollout.timeout_s, cfg.rollout.start_timeout_s)
        roles = init_roles(cfg.rollout.num_ranks, timeout_s=max(600.0, longest_answer_s + 60.0))
        if roles.role == ROLLOUT:
            return _serve_rollouts(roles, cfg)
        try:
            trainer = RLTrainer(cfg, stop, roles)
        except RolloutRankError as err:  # the engines did not start: nothing trained, nothing saved
            _exit_now(f"{err}; nothing was trained", roles.rank == 0)
        summary = trainer.run()
        if summary["exit_code"] == exit_codes.FAILED:
            _exit_now(summary["error"], roles.rank == 0)
        return summary


def _exit_now(error: str, report: bool) -> NoReturn:
    """End a training rank whose rollout ranks failed: the bridge's receiving thread still
    waits on them, and gloo joins such a wait before a process may exit normally."""
    if report:
        print(f"megatron-rl: error: {error}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(exit_codes.FAILED)


def _serve_rollouts(roles: RoleWorld, cfg: Config) -> dict:
    """A rollout rank's whole run: serve the trainer's commands; its summary (rank 0 of the
    launch reports the run)."""
    extension = None
    if cfg.environment.episodes:  # the episodes' tools run here, beside the engines
        extension = EpisodeService()
    startup_gc.resume()  # the engine is built on the trainer's first command
    served = serve(roles.bridge, extension)
    return {
        "run_dir": str(cfg.trainer.run_dir),
        "role": ROLLOUT,
        "commands": served,
        "exit_code": exit_codes.DONE,
        "error": None,
    }
