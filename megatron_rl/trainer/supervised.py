"""The loop of a supervised run (a reward model's, SFT's): data in, one optimizer update per step.

A step reads as the algorithm: the step's rows (a seeded order over epochs, a function of
the step alone, so a resumed run trains what the uninterrupted one would have) -> one
optimizer update through Megatron's schedules -> metrics -> the eval sets when eval is due
-> checkpoint. What differs between the recipes (the model's role, the data, the batch,
the loss, the eval metrics, the progress line) is a :class:`SupervisedRecipe`; the run
dir, resume, metrics and loggers, stop signals and checkpoints are the same as RL's.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from megatron_rl import platform
from megatron_rl.checkpoint import Checkpointer
from megatron_rl.config import Config, dump_yaml, to_dict
from megatron_rl.from_config import setup, validate
from megatron_rl.launch import exit_codes, startup_gc
from megatron_rl.launch.signals import StopSignals, stop_line
from megatron_rl.launch.slurm_env import SlurmEnv
from megatron_rl.launch.status import write_status
from megatron_rl.models.hf_config import arch_from_hf
from megatron_rl.parallel import initialize
from megatron_rl.schedules import epoch_order, local_batch, train_step
from megatron_rl.schedules.batch import TrainBatch
from megatron_rl.trainer.loggers import open_loggers
from megatron_rl.trainer.metrics import MetricsLog
from megatron_rl.trainer.state import RunCheckpoint, choose_resume_step


class SupervisedRecipe(Protocol):
    """What a supervised recipe brings to the loop."""

    role: str
    """The model built: actor (a language model) or critic (a scalar head)."""
    freeze_head_bias: bool
    micro: object
    """The placement of a mini-batch (schedules.packing.Microbatching)."""
    loss: object
    summary_metric: str
    """The val/<set>/<this> metric whose first and last values ``train`` reports."""

    def checkpoint_extra(self) -> dict:
        """Entries every checkpoint's ``extra`` carries (what the model is)."""

    def num_rows(self) -> int:
        """Training rows the steps draw from."""

    def batch(self, indices: list[int]) -> TrainBatch:
        """The mini-batch of these training rows."""

    def evaluate(self, model) -> dict:
        """val/<set>/... metrics of ``model`` (a setup.Trainable), on every rank."""

    def progress_line(self, total: int) -> Callable[[dict], str]:
        """The progress line of a metrics row."""


def step_indices(step: int, rows_per_step: int, num_rows: int, seed: int) -> list[int]:
    """The rows of ``step`` (1-based): the next ``rows_per_step`` of a sequence of epochs,
    each a fresh permutation drawn from (seed, epoch)."""
    start = (step - 1) * rows_per_step
    out, orders = [], {}
    for position in range(start, start + rows_per_step):
        epoch, index = divmod(position, num_rows)
        if epoch not in orders:
            orders[epoch] = epoch_order(num_rows, seed, 0, epoch)
        out.append(int(orders[epoch][index]))
    return out


@dataclasses.dataclass(frozen=True)
class RunInputs:
    """What a recipe reads its data with: the run's directory and base, the tokenizer, this rank."""

    run_dir: Path
    base_dir: Path
    tokenizer: object
    rank: int


RecipeFactory = Callable[[Config, RunInputs], SupervisedRecipe]
"""(config, inputs) -> the recipe, its data read and checked (before any model is built)."""


class SupervisedTrainer:
    """A supervised run, built once from its config; :meth:`run` trains to trainer.max_steps."""

    def __init__(self, cfg: Config, stop_signals: StopSignals, make_recipe: RecipeFactory):
        platform.init_distributed(cfg.trainer.dist_timeout_s)
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.cfg = validate(cfg, self.world)
        self.stop_signals = stop_signals
        self.run_dir = Path(cfg.trainer.run_dir)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(dump_yaml(cfg))
        resume_step = choose_resume_step(self.run_dir / "checkpoints", cfg.checkpoint.on_corrupt)
        torch.manual_seed(cfg.trainer.seed)
        self.base_dir = setup.base_model_dir(cfg, self.rank)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(self.base_dir))
        self.recipe = make_recipe(cfg, RunInputs(self.run_dir, self.base_dir, tokenizer, self.rank))
        arch = arch_from_hf(self.base_dir)
        layout = initialize(
            cfg.parallel, seed=cfg.trainer.seed, model=arch.shape(), timeout_s=cfg.trainer.dist_timeout_s
        )
        self.model = setup.build_trainable(
            self.recipe.role,
            arch,
            layout,
            setup.build_options(cfg),
            cfg.trainer.lr,
            self.base_dir,
            freeze_head_bias=self.recipe.freeze_head_bias,
        )
        self.checkpoint = RunCheckpoint(Checkpointer(), self.run_dir / "checkpoints", cfg.checkpoint, self.base_dir)
        extra = self.checkpoint.resume(self.model, None, resume_step)
        self.first_step = 1 if extra is None else int(extra["step"]) + 1
        if extra is not None and self.rank == 0:
            print(f"resumed from {self.checkpoint.root} step {extra['step']}", flush=True)
        self.log = MetricsLog(
            self.run_dir,
            enabled=self.rank == 0,
            total_steps=cfg.trainer.max_steps,
            resume_after=self.first_step - 1,
            loggers=open_loggers(cfg.trainer.loggers, self.run_dir, cfg.trainer.project, to_dict(cfg))
            if self.rank == 0
            else (),
            line=self.recipe.progress_line(cfg.trainer.max_steps),
        )
        self.slurm = SlurmEnv.from_environ()
        self.history: list[dict] = []
        self.eval_history: list[dict] = []
        self.stop_signal = None

    def run(self) -> dict:
        """Train from the step after the newest checkpoint to trainer.max_steps, or until a stop signal."""
        startup_gc.resume()
        step = self.first_step - 1
        if step == 0 and self.cfg.eval.due(0, self.cfg.trainer.max_steps):  # the starting weights, as step 0
            self.log.write(self.evaluate(0, {"step": 0}))
        for step in range(self.first_step, self.cfg.trainer.max_steps + 1):
            if self.step(step):
                break
        return self.close(step)

    def step(self, step: int) -> bool:
        """One update on the step's rows; True when a stop signal ends the run after it."""
        started = time.perf_counter()
        cfg = self.cfg
        indices = step_indices(step, cfg.trainer.global_batch_size, self.recipe.num_rows(), cfg.trainer.seed)
        batch = self.recipe.batch(indices)
        self.model.set_lr(self._lr(step))
        with self.model.active():
            metrics = train_step(
                self.model.chunks,
                self.model.optimizer,
                local_batch(self.model.chunks, batch, self.recipe.micro),
                self.recipe.loss,
                self.recipe.micro,
            )
        metrics = {"step": step, **metrics, "timing/step_s": time.perf_counter() - started}
        metrics["slurm/restart_count"] = self.slurm.restart_count
        self.stop_signal = self.stop_signals.agree()
        stopping = self.stop_signal is not None
        if not stopping:  # a stop saves first: eval must not delay a preemption
            self.evaluate(step, metrics)
        self.history.append(metrics)
        self.log.write(metrics)
        if stopping or self.checkpoint.due(step, cfg.trainer.max_steps):
            self.checkpoint.save(step, self.model, None, self.recipe.checkpoint_extra())
        if stopping and self.rank == 0:
            print(stop_line(self.stop_signal, step, self.checkpoint.root), flush=True)
        return stopping

    def evaluate(self, step: int, metrics: dict) -> dict:
        """The recipe's val/<set>/... metrics of the weights after ``step``, when due."""
        if not self.cfg.eval.due(step, self.cfg.trainer.max_steps):
            return metrics
        started = time.perf_counter()
        with self.model.active():
            metrics.update(self.recipe.evaluate(self.model))
        metrics["timing/eval_s"] = time.perf_counter() - started
        self.eval_history.append(metrics)
        return metrics

    def _lr(self, step: int) -> float:
        """Linear warm-up over trainer.lr_warmup_steps, then constant."""
        warm = self.cfg.trainer.lr_warmup_steps
        return self.cfg.trainer.lr * (min(1.0, step / warm) if warm else 1.0)

    def close(self, step: int) -> dict:
        """Commit the saves in flight, write the run's status; the run's summary."""
        self.checkpoint.close()
        code = exit_codes.DONE if step >= self.cfg.trainer.max_steps else exit_codes.STOPPED
        if self.rank == 0:
            write_status(
                self.run_dir, code, step, None if self.stop_signal is None else self.stop_signal.name, self.slurm
            )
        self.log.close()
        out = {"run_dir": str(self.run_dir), "steps": len(self.history), "last_step": step, "exit_code": code}
        out["error"] = None
        losses = [r["train/loss"] for r in self.history if math.isfinite(r["train/loss"])]
        if losses:
            out.update(first_loss=sum(losses[:5]) / len(losses[:5]), last_loss=sum(losses[-5:]) / len(losses[-5:]))
        return {**out, "val": first_and_last(self.eval_history, self.recipe.summary_metric)}


def first_and_last(eval_history: list[dict], metric: str) -> dict:
    """val/<set>/<metric> -> ((first step, value), (last step, value)) over the evaluations."""
    if not eval_history:
        return {}
    first, last = eval_history[0], eval_history[-1]
    return {
        key: ((first["step"], first[key]), (last["step"], last[key]))
        for key in first
        if key.startswith("val/") and key.endswith(f"/{metric}")
    }
