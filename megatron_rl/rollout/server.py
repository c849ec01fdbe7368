"""The rollout ranks' side of disaggregated rollouts: their engines, driven by the trainer's commands.

The rollout ranks run :func:`serve`: build the engines when told (``Start``), take the next
command, run it on their engines exactly as a colocated launch of their size would (the
prompts dealt to the replicas and gathered back, :class:`~megatron_rl.rollout.replicas.Replicas`),
and rollout rank 0 answers with the command's number. Commands run one after another in
the order sent (:mod:`megatron_rl.rollout.client` says what that gives the trainer).
Whoever starts the server may give it a :class:`ServerExtension`: the commands of a layer
above rollout and their handlers, served as rollout's own are (multi-turn episodes, their
tools on the rollout ranks: :mod:`megatron_rl.environments.served`), so rollout knows
nothing of them. A partial generation (``rollout.partial``,
:mod:`megatron_rl.rollout.partial`) is the exception to the order: it runs the weight
updates sent after it between its chunks, and its samples record the version of every
token. Weights arrive as one byte tensor per bucket (:mod:`megatron_rl.rollout.buckets`),
broadcast from the HF-layout export the colocated sync loads, so the same in-place loader
and weight check run here. A command that fails is answered with its error and ends the
rollout rank's process too.
"""

from __future__ import annotations

import collections
import os
import queue
import time
from typing import Any, Callable, Mapping, Optional, Protocol

import torch

from megatron_rl.rollout.buckets import bucket_bytes, unpack_bucket
from megatron_rl.rollout.channel import ROLLOUT_LEADER, TRAINER, Channel, Inbox
from megatron_rl.rollout.commands import (
    BUCKET_COMMANDS,
    COMMANDS,
    CheckBucket,
    Command,
    Continue,
    FinishUpdate,
    Generate,
    GenerateEval,
    Generation,
    LoadAdapter,
    LoadBucket,
    PromptLogprobs,
    Start,
    Stop,
    UnknownCommandError,
    check_command,
)
from megatron_rl.rollout.replicas import Replicas
from megatron_rl.rollout.types import EvalSamples, Sample

CHUNK_PAUSE_ENV = "MRL_ROLLOUT_CHUNK_PAUSE_S"
"""Seconds a rollout rank waits after every chunk of a partial generation (default 0): a
rollout side slower than training, made on purpose, for tests and drills of partial
rollouts (on a small CPU model a batch is often done before the step's weights arrive)."""

BETWEEN_CHUNKS = (LoadBucket, CheckBucket, LoadAdapter, FinishUpdate, PromptLogprobs)
"""Commands a partial generation runs between two of its chunks: they use the engine only
between its calls (a weight update, its read-back, the parity guard's prompt logprobs)."""

Handler = Callable[["RolloutServer", Any, Optional[list]], Any]
"""Serves one command: called with the server, the command and its bucket (None but for
bucket commands); what it returns is the answer."""


class ServerExtension(Protocol):
    """Commands of a layer above rollout, served on the rollout ranks beside rollout's own.

    The layer's command types must pickle (module-level frozen dataclasses) and carry no
    bucket; the client that sends them is told of them (``RolloutClient(extra_commands=...)``).
    Handlers reach the engines through the server (:attr:`RolloutServer.replicas`, built by
    ``Start``) and read what they need of it (``version``, ``leader``, :meth:`RolloutServer.take_idle_s`)."""

    def handlers(self) -> Mapping[type, Handler]:
        """The handler of each of the layer's command types."""
        ...

    def close(self) -> None:
        """Release what the handlers built; called once, at ``Stop``, before it is answered."""
        ...


class RolloutServer:
    """The rollout side: one engine per rank (replicas and engine TP as in a colocated launch
    of the rollout ranks' size), driven by the trainer's commands.

    Commands are numbered in the order sent and run in that order, with one exception: a
    partial generation (:mod:`megatron_rl.rollout.partial`) runs the :data:`BETWEEN_CHUNKS`
    commands waiting at the head of the queue between two chunks (a weight update always
    to its ``finish``), so their answers can come before the generation's; the client reads
    answers by number."""

    def __init__(self, bridge: tuple, extension: Optional[ServerExtension] = None):
        import torch.distributed as dist

        self.down, self.up = Channel(bridge[0]), Channel(bridge[1])
        self.leader = self.up.rank == ROLLOUT_LEADER
        self.replicas: Optional[Replicas] = None
        """This rank's engine among the rollout world's replicas, built by ``Start``."""
        self.extension = extension
        self.handlers = command_handlers(extension)
        """Every command's handler but :class:`Stop`'s: :data:`HANDLERS` and the extension's."""
        self.rank = dist.get_rank()
        self.inbox = Inbox(self._receive, is_last=lambda m: isinstance(m[0], Stop), name="rollout-commands")
        self.pending: collections.deque = collections.deque()
        """(number, command, bucket) taken from the inbox and not run yet, in order."""
        self.taken = 0
        """Commands taken from the inbox (the next one's number)."""
        self.version = 0
        """Weight updates finished: the policy version the engines serve (the client's count)."""
        self.idle_s = 0.0
        """Time spent waiting for commands since the previous generation."""
        self.between_s = 0.0
        """Time the current generation spent running other commands between its chunks."""
        self.chunk_pause_s = float(os.environ.get(CHUNK_PAUSE_ENV, "0"))
        """Wait after every chunk of a partial generation (:data:`CHUNK_PAUSE_ENV`); counted as generation time."""

    def _receive(self) -> tuple[Command, Optional[list]]:
        command = self.down.broadcast_object(root=TRAINER)
        bucket = None
        if isinstance(command, BUCKET_COMMANDS):
            flat = torch.empty(bucket_bytes(command.specs), dtype=torch.uint8)
            bucket = unpack_bucket(command.specs, self.down.broadcast_tensor(flat, TRAINER))
        return command, bucket

    def _fetch(self, block: bool) -> bool:
        """Move the next command of the inbox to ``pending`` (waiting for one when ``block``)."""
        waited = time.perf_counter()
        try:
            command, bucket = self.inbox.get(timeout=None if block else 0)
        except queue.Empty:
            return False
        finally:
            self.idle_s += time.perf_counter() - waited
        self.pending.append((self.taken, command, bucket))
        self.taken += 1
        return True

    def _take(self) -> tuple[int, Command, Optional[list]]:
        if not self.pending:
            self._fetch(block=True)
        return self.pending.popleft()

    def serve(self) -> int:
        """Run commands in order until :class:`Stop`; returns how many were served."""
        while True:
            number, command, bucket = self._take()
            if isinstance(command, Stop):
                if self.extension is not None:
                    self.extension.close()
                self._answer(number, "stopped", None)
                return number
            self._serve_one(number, command, bucket)

    def _serve_one(self, number: int, command: Command, bucket: Optional[list]) -> None:
        try:
            value = self._run(command, bucket)
        except Exception as err:
            self._answer(number, "error", f"rollout rank {self.rank}: {type(err).__name__}: {err}")
            raise
        self._answer(number, "ok", value)

    def _answer(self, number: int, status: str, value: Any) -> None:
        if self.leader:
            self.up.send_object((number, status, value), TRAINER)

    def _run(self, command: Command, bucket: Optional[list]) -> Any:
        """Dispatch ``command`` to its handler by type (:attr:`handlers`)."""
        check_command(command, extra=tuple(c for c in self.handlers if c not in COMMANDS))
        handler = self.handlers.get(type(command))
        if handler is None:
            raise UnknownCommandError(f"{type(command).__name__} has no handler on the rollout ranks")
        return handler(self, command, bucket)

    def take_idle_s(self) -> float:
        """The time spent waiting for commands since the previous generation, which starts
        the count again (each generation reports the wait before it)."""
        idle, self.idle_s = self.idle_s, 0.0
        return idle

    def _start(self, command: Start, bucket: None) -> None:
        from megatron_rl.rollout.engine import RolloutEngine

        self.replicas = Replicas(RolloutEngine(command.model_dir, command.config))

    def _generate_eval(self, command: GenerateEval, bucket: None) -> EvalSamples:
        groups = self.replicas.generate_eval(command.prompt_ids, command.sampling, command.seeds).groups
        return EvalSamples(groups, policy_version=self.version)

    def _continue(self, command: Continue, bucket: None) -> list[Sample]:
        return self.replicas.continue_samples(command.samples, command.sampling)

    def _prompt_logprobs(self, command: PromptLogprobs, bucket: None) -> list[list[float]]:
        return self.replicas.prompt_logprobs(command.sequences)

    def _load(self, command: LoadBucket, bucket: list) -> str:
        return self.replicas.load_weights(bucket)

    def _load_adapter(self, command: LoadAdapter, bucket: list) -> None:
        self.replicas.load_adapter(dict(bucket), command.peft_config)

    def _finish(self, command: FinishUpdate, bucket: None) -> None:
        self.replicas.finish_weight_update()
        self.version += 1

    def _generate(self, request: Generate, bucket: None) -> Generation:
        """The batch, whole or in chunks; its time excludes the commands run between chunks."""
        from megatron_rl.rollout.partial import generate_in_chunks

        idle = self.take_idle_s()
        started, self.between_s = time.perf_counter(), 0.0
        if request.chunk_tokens is None:
            groups = self.replicas.generate_groups(request.prompts, request.sampling)
        else:
            groups = generate_in_chunks(
                self.replicas,
                request.prompts,
                request.sampling,
                request.chunk_tokens,
                self.version,
                self._between_chunks,
            )
        return Generation(groups, time.perf_counter() - started - self.between_s, idle)

    def _between_chunks(self) -> int:
        """Run the :data:`BETWEEN_CHUNKS` commands every rollout rank has waiting at the head
        of its queue, and the rest of a weight update they begin (it is sent whole: the
        engines never sample with half of one); the version the next chunk samples."""
        time.sleep(self.chunk_pause_s)
        started = time.perf_counter()
        while self._fetch(block=False):
            pass
        ready = 0
        for _, command, _ in self.pending:
            if not isinstance(command, BETWEEN_CHUNKS):
                break
            ready += 1
        ready = _fewest_over_ranks(ready)  # the rollout ranks' inboxes fill at their own pace
        updating = False
        while ready > 0 or updating:
            number, command, bucket = self._take()
            if not isinstance(command, BETWEEN_CHUNKS):
                raise RuntimeError(f"command {number} ({type(command).__name__}) arrived inside a weight update")
            self._serve_one(number, command, bucket)
            updating, ready = isinstance(command, BUCKET_COMMANDS), ready - 1
        self.between_s += time.perf_counter() - started
        return self.version

    def _merged_check(self, command: CheckBucket, bucket: list):
        """Every rollout rank reads back its own engine; the results merged over the rollout world."""
        import torch.distributed as dist

        from megatron_rl.rollout.weight_check import WeightCheckResult

        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self.replicas.check_weights(bucket))
        return WeightCheckResult.merge_all(everyone)


HANDLERS: Mapping[type, Handler] = {
    Start: RolloutServer._start,
    Generate: RolloutServer._generate,
    GenerateEval: RolloutServer._generate_eval,
    Continue: RolloutServer._continue,
    PromptLogprobs: RolloutServer._prompt_logprobs,
    LoadBucket: RolloutServer._load,
    CheckBucket: RolloutServer._merged_check,
    LoadAdapter: RolloutServer._load_adapter,
    FinishUpdate: RolloutServer._finish,
}
"""The rollout side's handler of each of rollout's commands but :class:`Stop` (which ends
:meth:`RolloutServer.serve`)."""


def command_handlers(extension: Optional[ServerExtension]) -> dict[type, Handler]:
    """:data:`HANDLERS` and ``extension``'s; an extension may add commands, not take one of rollout's over."""
    handlers = dict(HANDLERS)
    if extension is None:
        return handlers
    added = dict(extension.handlers())
    taken = [command.__name__ for command in added if command in COMMANDS]
    if taken:
        raise ValueError(f"a server extension cannot serve rollout's own commands: {', '.join(taken)}")
    handlers.update(added)
    return handlers


def _fewest_over_ranks(count: int) -> int:
    """The smallest ``count`` over the rollout ranks (their default world)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return count
    value = torch.tensor([count])
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value)


def serve(bridge: tuple, extension: Optional[ServerExtension] = None) -> int:
    """The whole life of a rollout rank: build the engine when told, serve until told to stop
    (``extension``: the commands of a layer above rollout, served too)."""
    return RolloutServer(bridge, extension).serve()
