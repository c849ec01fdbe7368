"""Saving and resuming a run: the actor and its optimizer, the critic beside it, and the
``extra`` entries the trainer adds (step, data position, rollout source state, HAPO's
entropy statistics, what an HF export needs).

Layout under ``<run_dir>/checkpoints``: the actor's committed steps, and the critic's in
``critic/``. The critic is saved first: saves commit in the order they were made, so once
the actor's step is committed the critic's is too, and resume reads the actor's newest step.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from megatron_rl import checkpoint
from megatron_rl.bridge.hf_files import weights_digest
from megatron_rl.checkpoint import Checkpointer
from megatron_rl.checkpoint.recovery import newest_intact_step
from megatron_rl.config import ConfigError
from megatron_rl.config.schema import CheckpointConfig, LoraConfig
from megatron_rl.from_config.setup import Trainable

CRITIC_DIR = "critic"
"""The critic's checkpoints, under the actor's root (step directories only match there)."""


def choose_resume_step(root: Path, on_corrupt: str) -> Optional[int]:
    """Collective, before any model is built: the newest intact committed step under
    ``root`` (and its critic's), or None for a fresh run.

    Rank 0 reads the candidate in full against its checksums (checkpoint.recovery) and
    every rank gets its answer, so a damaged step stops the run (``on_corrupt=fail``, a
    ConfigError: exit 2) or is set aside (``fallback``) before any work is done.
    """
    root = Path(root)
    answer: list = [None]
    if dist.get_rank() == 0:
        try:
            answer[0] = newest_intact_step(
                [root, root / CRITIC_DIR], on_corrupt, warn=lambda line: print(line, file=sys.stderr, flush=True)
            )
        except checkpoint.CheckpointError as err:
            answer[0] = str(err)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], str):
        raise ConfigError(answer[0])
    return answer[0]


class RunCheckpoint:
    """The run's checkpoints, written and read through one checkpointer.

    A LoRA run (``lora``) saves what trains only (the actor's adapters, the critic's adapters
    and value head) and the digest of the base they belong to (:func:`check_adapter_base`);
    a resume loads them over the base loaded from ``base_dir``."""

    def __init__(
        self,
        checkpointer: Checkpointer,
        root: Path,
        config: CheckpointConfig,
        base_dir: Path,
        lora: Optional[LoraConfig] = None,
    ):
        self.checkpointer = checkpointer
        self.root = Path(root)
        self.config = config
        # An HF export of a step needs the architecture it was trained from, and takes the
        # tokenizer and generation config from the HF directory it started from.
        self.hf_config = json.loads((Path(base_dir) / "config.json").read_text())
        self.hf_source_dir = str(Path(base_dir).resolve())
        self.lora = None
        """``extra["lora"]`` of a LoRA run's steps (what an export of the adapters needs)."""
        if lora is not None:
            self.lora = {**dataclasses.asdict(lora), "adapters_only": True, "base_digest": weights_digest(base_dir)}

    def due(self, step: int, last_step: int) -> bool:
        """Every checkpoint.save_interval steps, and at the last step."""
        interval = self.config.save_interval
        return step == last_step or bool(interval and step % interval == 0)

    def save(self, step: int, actor: Trainable, critic: Optional[Trainable], extra: dict) -> None:
        """Collective: the critic, then the actor with ``extra`` (async as configured)."""
        cfg = self.config
        options = dict(
            async_save=cfg.async_save,
            keep_last=cfg.keep_last,
            snapshot=cfg.snapshot if cfg.async_save else "at_save",
            trainable_only=self.lora is not None,
        )
        if critic is not None:
            with critic.active():
                self.checkpointer.save(
                    self.root / CRITIC_DIR,
                    step,
                    model=critic.chunks,
                    optimizer=critic.optimizer,
                    extra={"step": step},
                    **options,
                )
        extra = {
            "step": step,
            **extra,
            "hf_config": self.hf_config,
            "hf_expert_style": "per_expert",
            "hf_source_dir": self.hf_source_dir,
        }
        if self.lora is not None:
            extra["lora"] = self.lora
        self.checkpointer.save(self.root, step, model=actor.chunks, optimizer=actor.optimizer, extra=extra, **options)

    def resume(self, actor: Trainable, critic: Optional[Trainable], step: Optional[int]) -> Optional[dict]:
        """Load ``step`` (from :func:`choose_resume_step`) into the models (any saved layout
        into the current one); its ``extra``, or None for a fresh run (``step`` None)."""
        if step is None:
            return None
        if critic is not None:  # first, so that the actor's RNG state is the one restored
            if step not in checkpoint.committed_steps(self.root / CRITIC_DIR):
                raise ConfigError(
                    f"{self.root} step {step} has no critic checkpoint in {self.root / CRITIC_DIR}: "
                    "it was saved by a recipe without a critic; resume it with that recipe or use "
                    "a new trainer.run_dir"
                )
            with critic.active():
                self.checkpointer.load(
                    self.root / CRITIC_DIR,
                    model=critic.chunks,
                    optimizer=critic.optimizer,
                    step=step,
                    trainable_only=self.lora is not None,
                )
        return self.checkpointer.load(
            self.root, model=actor.chunks, optimizer=actor.optimizer, step=step, trainable_only=self.lora is not None
        )

    def close(self) -> None:
        """Commit every save in flight (before the process exits) and stop the writer."""
        self.checkpointer.close()
