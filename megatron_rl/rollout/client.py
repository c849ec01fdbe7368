"""The training ranks' handle on vLLM engines of rollout ranks of their own.

With ``rollout.placement: disaggregated`` the engines live on the rollout ranks
(:mod:`megatron_rl.launch.roles`), which serve the trainer's commands
(:mod:`megatron_rl.rollout.server`). The trainer talks to them through a
:class:`RolloutClient`, a :class:`~megatron_rl.rollout.backend.RolloutBackend` as the
colocated :class:`~megatron_rl.rollout.replicas.Replicas` are (``config``, the weight-sync
calls ``load_weights`` / ``check_weights`` / ``finish_weight_update``, ``prompt_logprobs``
for the parity guard, ``generate_eval`` for held-out evaluation, ``generate_groups``), plus,
for rollouts that run ahead of training, ``submit`` / ``result``. Every training rank makes
every call, in lockstep; training rank 0 alone talks over the bridge and the results every
rank needs are broadcast over the training world.

Commands are typed messages (:mod:`megatron_rl.rollout.commands`), run one after another in
the order sent, so a generation submitted before a weight update samples with the old
weights, one submitted after it with the new ones: the client counts the updates it sent
(``version``), which is the policy version of everything generated for a command sent
then. Held-out evaluation (:meth:`RolloutClient.generate_eval`) is such a command too, sent
after a step's weight update: it samples the step's weights, and its answer carries the
version the rollout ranks served. A layer above rollout may send commands of its own,
which the client is told of (``extra_commands``) and the rollout ranks serve through a
:class:`~megatron_rl.rollout.server.ServerExtension` (multi-turn episodes:
:mod:`megatron_rl.environments.served`). Weights travel as one byte tensor per bucket
(:mod:`megatron_rl.rollout.buckets`). A command that fails on the rollout side is answered
with its error, raised on every training rank as :class:`RolloutRankError` by the next
:meth:`~RolloutClient.result`.
"""

from __future__ import annotations

import dataclasses
import queue
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch

from megatron_rl.data import PromptBatch
from megatron_rl.rollout.buckets import pack_bucket
from megatron_rl.rollout.channel import ROLLOUT_LEADER, Channel, Inbox
from megatron_rl.rollout.commands import (
    BUCKET_COMMANDS,
    CheckBucket,
    Continue,
    FinishUpdate,
    Generate,
    GenerateEval,
    LoadAdapter,
    LoadBucket,
    PromptLogprobs,
    Start,
    Stop,
    check_command,
)
from megatron_rl.rollout.types import EngineConfig, EvalSamples, Sample, Sampling


class RolloutRankError(RuntimeError):
    """A command failed on a rollout rank; the message names the rank and the error."""


class RolloutClient:
    """The training ranks' handle on the rollout ranks' engines (see the module docstring), a
    :class:`~megatron_rl.rollout.backend.RolloutBackend`.

    ``bridge``: the (down, up) groups on training rank 0, None on the other training ranks.
    ``answer_timeout_s``: the longest wait for one answer before the rollout ranks count as hung;
    ``start_timeout_s``: the same for the first one, the engines' start. ``extra_commands``:
    the command types of a layer above rollout that this client may send besides rollout's
    own (the rollout ranks' server extension serves them)."""

    config: EngineConfig
    extra_commands: tuple[type, ...] = ()
    """Empty unless told (also for a client made without ``__init__``, as the unit tests make)."""

    def __init__(
        self,
        bridge: Optional[tuple],
        config: EngineConfig,
        model_dir: Path,
        who: str = "the rollout ranks",
        answer_timeout_s: float = 3600.0,
        start_timeout_s: float = 3600.0,
        extra_commands: tuple[type, ...] = (),
    ):
        self.config, self.extra_commands = config, tuple(extra_commands)
        self.who, self.answer_timeout_s = who, answer_timeout_s
        self.down = self.inbox = None
        self.broken: Optional[str] = None
        """Why the rollout ranks cannot be reached any more (training rank 0 finds out on a
        send; every training rank learns it from the next :meth:`result`)."""
        if bridge is not None:
            self.down, up = Channel(bridge[0], send_timeout_s=answer_timeout_s), Channel(bridge[1])
            self.inbox = Inbox(
                lambda: up.recv_object(ROLLOUT_LEADER), is_last=lambda m: m[1] == "stopped", name="rollout-answers"
            )
        self.sent = 0
        """Commands sent (the next command's number), counted alike on every training rank."""
        self.version = 0
        """Weight updates sent: the policy version of what a generate sent now samples."""
        self._kept: set[int] = set()
        """Commands whose answer someone will ask for (the others are read and dropped)."""
        self._answers: dict[int, tuple[str, Any]] = {}
        """Answers read while waiting for a later one."""
        started = time.perf_counter()
        self.result(
            self.submit(Start(str(model_dir), config)),
            timeout_s=start_timeout_s,
            timeout_key="rollout.start_timeout_s",
        )
        self.build_s = time.perf_counter() - started
        """Seconds until every rollout rank had its engine (the rollout side builds them)."""

    # -- generation -------------------------------------------------------------------

    def generate_groups(self, prompts: PromptBatch, sampling: Sampling, on_group=None) -> list[list[Sample]]:
        """``sampling.n`` samples per prompt, generated on the rollout ranks, on every training
        rank. The batch comes back whole: ``on_group`` is not called (scoring starts after)."""
        return self.result(self.submit(Generate(prompts, sampling))).groups

    def generate_eval(
        self, prompt_ids: Sequence[Sequence[int]], sampling: Sampling, seeds: Sequence[int]
    ) -> EvalSamples:
        """Held-out evaluation's samples from the rollout ranks, on every training rank, stamped
        with the version they served. Commands run in the order sent, so this samples the
        weights of every update sent before it (a batch generating ahead finishes first, under
        its own version): the version the training ranks hold, checked here."""
        command = GenerateEval([list(p) for p in prompt_ids], sampling, list(seeds))
        samples = self.result(self.submit(command))
        if samples.policy_version != self.version:
            raise RuntimeError(
                f"{self.who} evaluated policy version {samples.policy_version}; the training ranks hold {self.version}"
            )
        return samples

    def continue_samples(self, samples: list[Sample], sampling: Sampling) -> list[Sample]:
        """Every unfinished sample extended by one more window (T-PPO), on every training rank."""
        return self.result(self.submit(Continue(list(samples), sampling)))

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        return self.result(self.submit(PromptLogprobs([list(s) for s in sequences])))

    # -- weights ----------------------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
        """Send one bucket to every rollout rank, which loads it after the commands before it
        (training rank 0 sends; the others hold the same bucket). Does not wait."""
        self.submit(LoadBucket(), list(named_tensors), keep=False)
        return "remote"

    def check_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]):
        """What the rollout ranks serve for a bucket, read back and compared with it (merged over
        the rollout ranks), on every training rank. Waits for the commands before it."""
        return self.result(self.submit(CheckBucket(), list(named_tensors)))

    def load_adapter(self, tensors: dict[str, torch.Tensor], peft_config: dict) -> None:
        """Send the adapter to every rollout rank, whose engines serve it from the next
        generation on (training rank 0 sends; the others hold the same). Does not wait."""
        self.submit(LoadAdapter(peft_config), list(tensors.items()), keep=False)

    def finish_weight_update(self) -> None:
        """The update is complete: what is generated from now on samples the new version."""
        self.submit(FinishUpdate(), keep=False)
        self.version += 1

    def close(self) -> None:
        """Release the rollout ranks (their processes end with the launch)."""
        self.submit(Stop(), keep=False)
        if self.inbox is not None and self.broken is None:
            while self.inbox.get(timeout=self.answer_timeout_s)[1] != "stopped":
                pass

    # -- commands ---------------------------------------------------------------------

    def submit(self, command: object, bucket: Optional[list] = None, keep: bool = True) -> int:
        """Send ``command`` (training rank 0; the others only count it), with ``bucket`` after
        it for a bucket command; its number, to ask :meth:`result` for (``keep=False``: nobody
        will; its answer is only checked for errors). Raises
        :class:`~megatron_rl.rollout.commands.UnknownCommandError` for anything but a
        :mod:`~megatron_rl.rollout.commands` message or one of ``extra_commands``, on every
        training rank."""
        check_command(command, self.extra_commands)
        if isinstance(command, BUCKET_COMMANDS) != (bucket is not None):
            names = ", ".join(c.__name__ for c in BUCKET_COMMANDS)
            raise ValueError(f"{type(command).__name__}: a bucket goes with {names} only")
        number, self.sent = self.sent, self.sent + 1
        if keep:
            self._kept.add(number)
        if self.down is not None and self.broken is None:
            if bucket is not None:
                specs, flat = pack_bucket(bucket)
                command = dataclasses.replace(command, specs=tuple(specs))
            try:
                self.down.broadcast_object(command)
                if bucket is not None:
                    self.down.broadcast_tensor(flat)
            except RuntimeError as err:  # frozen past rollout.timeout_s, or gone
                self.broken = (
                    f"{self.who} did not take command {number} ({type(command).__name__}): gone, or hung "
                    f"past rollout.timeout_s={self.answer_timeout_s:g} s ({err})"
                )
        return number

    def result(self, number: int, timeout_s: Optional[float] = None, timeout_key: str = "rollout.timeout_s") -> Any:
        """Command ``number``'s answer on every training rank (collective over the training
        world); raises :class:`RolloutRankError` when it, or any command before it, failed.
        ``timeout_s`` (default ``answer_timeout_s``) bounds each wait for an answer; the error
        names ``timeout_key``, the setting that gave it."""
        import torch.distributed as dist

        timeout_s = self.answer_timeout_s if timeout_s is None else timeout_s
        answer = [None]
        if self.broken is not None:
            answer[0] = ("error", self.broken)
        elif self.inbox is not None:
            try:
                answer[0] = self._await(number, timeout_s)
            except queue.Empty:
                answer[0] = (
                    "error",
                    f"{self.who} did not answer command {number} within {timeout_key}="
                    f"{timeout_s:g} s: hung, or slower than that",
                )
            except (RuntimeError, OSError) as err:  # the bridge broke: a rollout rank died
                answer[0] = ("error", f"{self.who} stopped answering (the bridge failed: {err})")
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(answer, src=0)
        status, value = answer[0]
        if status == "error":
            raise RolloutRankError(value)
        return value

    def _await(self, number: int, timeout_s: float) -> tuple[str, Any]:
        """Read answers until ``number``'s, keeping the ones still to be asked for (a partial
        generation answers the commands it ran between its chunks before itself); an error
        answers whoever is waiting."""
        self._kept.discard(number)
        while number not in self._answers:
            got, status, value = self.inbox.get(timeout=timeout_s)
            if status == "error":
                return status, value
            if got == number or got in self._kept:
                self._answers[got] = (status, value)
        return self._answers.pop(number)
