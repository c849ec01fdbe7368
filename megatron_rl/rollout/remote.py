"""vLLM on rollout ranks of their own: the training side's client, the rollout side's server.

With ``rollout.placement: disaggregated`` the engines live on the rollout ranks
(:mod:`megatron_rl.launch.roles`). The trainer talks to them through a
:class:`RolloutClient`, which offers what the trainer uses of a colocated engine (``config``,
the weight-sync calls ``load_weights`` / ``check_weights`` / ``finish_weight_update``,
``prompt_logprobs`` for the parity guard, ``generate_eval`` for held-out evaluation) plus
``generate_groups``, and, for rollouts that run ahead of training, ``submit`` / ``result``.
Every training rank makes every call, in lockstep; training rank 0 alone talks over the
bridge and the results every rank needs are broadcast over the training world.

Commands are typed messages (:mod:`megatron_rl.rollout.commands`), one frozen dataclass
per command; the client and the colocated engine both implement
:class:`~megatron_rl.rollout.backend.RolloutBackend`.

The rollout ranks run :func:`serve`: take the next command, run it on their engines
exactly as a colocated launch of their size would (prompts dealt to the replicas and
gathered back, :mod:`megatron_rl.rollout.replicas`), and rollout rank 0 answers with the
command's number. Commands run one after another in the order sent, so a generation
submitted before a weight update samples with the old weights, one submitted after it
with the new ones: the client counts the updates it sent (``version``), which is the
policy version of everything generated for a command sent then. Held-out evaluation
(:meth:`RolloutClient.generate_eval`) is such a command too, sent after a step's weight
update: it samples the step's weights, and its answer carries the version the rollout
ranks served. A run of multi-turn episodes sends its
:class:`~megatron_rl.environments.spec.EpisodeSpec` with ``Start``; the rollout ranks build
the environment and its driver beside their engines and run each ``GenerateEpisodes``
batch to its end, tools on their ranks, between two weight updates. A partial generation
(``rollout.partial``, :mod:`megatron_rl.rollout.partial`) is the exception: it runs the
weight updates sent after it between its chunks, and its samples record the version of
every token. Weights arrive as one byte tensor per bucket,
broadcast from the HF-layout export the colocated sync loads, so the same in-place loader
and weight check run on the rollout side. A command that fails on the rollout side is
answered with its error, raised on every training rank as :class:`RolloutRankError` by the
next ``result``, and ends the rollout rank's process too.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import queue
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

import torch

from megatron_rl.data import PromptBatch
from megatron_rl.rollout.channel import ROLLOUT_LEADER, TRAINER, Channel, Inbox
from megatron_rl.rollout.commands import (
    BUCKET_COMMANDS,
    CheckBucket,
    Command,
    Continue,
    FinishUpdate,
    Generate,
    GenerateEpisodes,
    GenerateEval,
    LoadBucket,
    PromptLogprobs,
    Start,
    Stop,
    TensorSpec,
    UnknownCommandError,
    check_command,
)
from megatron_rl.rollout.replicas import Replicas
from megatron_rl.rollout.types import EngineConfig, EvalSamples, Sample, Sampling
from megatron_rl.utils.alignment import DTYPE_VIEW_ALIGN, align_up

if TYPE_CHECKING:
    from megatron_rl.environments.driver import DriverTimes
    from megatron_rl.environments.episode import EpisodeResult
    from megatron_rl.environments.spec import EpisodeSpec


class RolloutRankError(RuntimeError):
    """A command failed on a rollout rank; the message names the rank and the error."""


@dataclasses.dataclass(frozen=True)
class Generation:
    """What a :class:`~megatron_rl.rollout.commands.Generate` command answers."""

    groups: list[list[Sample]]
    seconds: float
    """Time the rollout ranks spent generating them."""
    idle_s: float
    """Time the rollout ranks waited for commands since the previous generation (between
    every two commands: before weight buckets too, not only before this one)."""


@dataclasses.dataclass(frozen=True)
class EpisodeGeneration:
    """What a :class:`~megatron_rl.rollout.commands.GenerateEpisodes` command answers."""

    results: list[EpisodeResult]
    """One per record, in record order."""
    times: DriverTimes
    """The rollout ranks' drivers' times, added up over the replicas."""
    seconds: float
    idle_s: float
    """As :class:`Generation`'s."""


def _layout(specs: Sequence[TensorSpec]) -> tuple[list[tuple[int, int]], int]:
    """(offset, bytes) of every tensor in the byte buffer, and the buffer's size."""
    slots, offset = [], 0
    for spec in specs:
        size = int(torch.Size(spec.shape).numel()) * torch.empty(0, dtype=spec.dtype).element_size()
        slots.append((offset, size))
        offset += align_up(size, DTYPE_VIEW_ALIGN)  # so each can be viewed in its dtype
    return slots, offset


def pack_bucket(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[TensorSpec], torch.Tensor]:
    """One byte tensor holding every tensor of a bucket, and what to cut it back into."""
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in named]
    slots, total = _layout(specs)
    flat = torch.zeros(total, dtype=torch.uint8)
    for (_, tensor), (offset, size) in zip(named, slots):
        flat[offset : offset + size] = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return specs, flat


def unpack_bucket(specs: Sequence[TensorSpec], flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views into ``flat`` with the names, shapes and dtypes of :func:`pack_bucket`."""
    slots, _ = _layout(specs)
    return [
        (spec.name, flat[offset : offset + size].view(spec.dtype).reshape(spec.shape))
        for spec, (offset, size) in zip(specs, slots)
    ]


def bucket_bytes(specs: Sequence[TensorSpec]) -> int:
    """The size of the byte tensor that carries a bucket of ``specs``."""
    return _layout(specs)[1]


class RolloutClient:
    """The training ranks' handle on the rollout ranks' engines (see the module docstring), a
    :class:`~megatron_rl.rollout.backend.RolloutBackend`.

    ``bridge``: the (down, up) groups on training rank 0, None on the other training ranks.
    ``answer_timeout_s``: the longest wait for one answer before the rollout ranks count as hung;
    ``start_timeout_s``: the same for the first one, the engines' start. ``episodes``: a run
    of multi-turn episodes, whose drivers the rollout ranks build beside their engines."""

    config: EngineConfig

    def __init__(
        self,
        bridge: Optional[tuple],
        config: EngineConfig,
        model_dir: Path,
        who: str = "the rollout ranks",
        answer_timeout_s: float = 3600.0,
        start_timeout_s: float = 3600.0,
        episodes: Optional[EpisodeSpec] = None,
    ):
        self.config = config
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
            self.submit(Start(str(model_dir), config, episodes)),
            timeout_s=start_timeout_s,
            timeout_key="rollout.start_timeout_s",
        )
        self.build_s = time.perf_counter() - started
        """Seconds until every rollout rank had its engine (the rollout side builds them)."""

    # -- generation -------------------------------------------------------------------

    def generate_groups(self, prompts: PromptBatch, sampling: Sampling) -> list[list[Sample]]:
        """``sampling.n`` samples per prompt, generated on the rollout ranks, on every training rank."""
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

    def submit(self, command: Command, bucket: Optional[list] = None, keep: bool = True) -> int:
        """Send ``command`` (training rank 0; the others only count it), with ``bucket`` after
        it for a bucket command; its number, to ask :meth:`result` for (``keep=False``: nobody
        will; its answer is only checked for errors). Raises :class:`UnknownCommandError` for
        anything but a :mod:`~megatron_rl.rollout.commands` message, on every training rank."""
        check_command(command)
        if isinstance(command, BUCKET_COMMANDS) != (bucket is not None):
            raise ValueError(f"{type(command).__name__}: a bucket goes with LoadBucket and CheckBucket only")
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


CHUNK_PAUSE_ENV = "MRL_ROLLOUT_CHUNK_PAUSE_S"
"""Seconds a rollout rank waits after every chunk of a partial generation (default 0): a
rollout side slower than training, made on purpose, for tests and drills of partial
rollouts (on a small CPU model a batch is often done before the step's weights arrive)."""

BETWEEN_CHUNKS = (LoadBucket, CheckBucket, FinishUpdate, PromptLogprobs)
"""Commands a partial generation runs between two of its chunks: they use the engine only
between its calls (a weight update, its read-back, the parity guard's prompt logprobs)."""


class RolloutServer:
    """The rollout side: one engine per rank (replicas and engine TP as in a colocated launch
    of the rollout ranks' size), driven by the trainer's commands.

    Commands are numbered in the order sent and run in that order, with one exception: a
    partial generation (:mod:`megatron_rl.rollout.partial`) runs the :data:`BETWEEN_CHUNKS`
    commands waiting at the head of the queue between two chunks (a weight update always
    to its ``finish``), so their answers can come before the generation's; the client reads
    answers by number."""

    def __init__(self, bridge: tuple):
        import torch.distributed as dist

        self.down, self.up = Channel(bridge[0]), Channel(bridge[1])
        self.leader = self.up.rank == ROLLOUT_LEADER
        self.replicas: Optional[Replicas] = None
        """This rank's engine among the rollout world's replicas, built by ``Start``."""
        self.episodes = None
        """The episode driver on this rank's engine (a run of multi-turn episodes)."""
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
                self._close_driver()
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
        """Dispatch ``command`` to its handler by type (:data:`HANDLERS`)."""
        check_command(command)
        handler = HANDLERS.get(type(command))
        if handler is None:
            raise UnknownCommandError(f"{type(command).__name__} has no handler on the rollout ranks")
        return handler(self, command, bucket)

    def _start(self, command: Start, bucket: None) -> None:
        from megatron_rl.rollout.engine import RolloutEngine

        self.replicas = Replicas(RolloutEngine(command.model_dir, command.config))
        if command.episodes is not None:
            from transformers import AutoTokenizer

            from megatron_rl.environments.replicas import EpisodeReplicas
            from megatron_rl.environments.spec import build_driver

            tokenizer = AutoTokenizer.from_pretrained(command.model_dir)
            driver = build_driver(command.episodes, self.replicas.engine, tokenizer, announce=self.leader)
            self.episodes = EpisodeReplicas(self.replicas, driver)

    def _close_driver(self) -> None:
        if self.episodes is not None:
            self.episodes.close()

    def _generate_episodes(self, command: GenerateEpisodes, bucket: None) -> EpisodeGeneration:
        """Every episode run to its end under the weights served now (no update runs inside)."""
        if self.episodes is None:
            raise RuntimeError("GenerateEpisodes: the engines were started without an episode spec")
        idle, self.idle_s = self.idle_s, 0.0
        started = time.perf_counter()
        results, times = self.episodes.run(command.records, command.seeds, self.version)
        return EpisodeGeneration(results, times, time.perf_counter() - started, idle)

    def _generate_eval(self, command: GenerateEval, bucket: None) -> EvalSamples:
        groups = self.replicas.generate_eval(command.prompt_ids, command.sampling, command.seeds).groups
        return EvalSamples(groups, policy_version=self.version)

    def _continue(self, command: Continue, bucket: None) -> list[Sample]:
        return self.replicas.continue_samples(command.samples, command.sampling)

    def _prompt_logprobs(self, command: PromptLogprobs, bucket: None) -> list[list[float]]:
        return self.replicas.prompt_logprobs(command.sequences)

    def _load(self, command: LoadBucket, bucket: list) -> str:
        return self.replicas.load_weights(bucket)

    def _finish(self, command: FinishUpdate, bucket: None) -> None:
        self.replicas.finish_weight_update()
        self.version += 1

    def _generate(self, request: Generate, bucket: None) -> Generation:
        """The batch, whole or in chunks; its time excludes the commands run between chunks."""
        from megatron_rl.rollout.partial import generate_in_chunks

        idle, self.idle_s = self.idle_s, 0.0
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


HANDLERS: dict[type, Callable[[RolloutServer, Any, Optional[list]], Any]] = {
    Start: RolloutServer._start,
    Generate: RolloutServer._generate,
    GenerateEpisodes: RolloutServer._generate_episodes,
    GenerateEval: RolloutServer._generate_eval,
    Continue: RolloutServer._continue,
    PromptLogprobs: RolloutServer._prompt_logprobs,
    LoadBucket: RolloutServer._load,
    CheckBucket: RolloutServer._merged_check,
    FinishUpdate: RolloutServer._finish,
}
"""The rollout side's handler of each command but :class:`Stop` (which ends :meth:`RolloutServer.serve`);
each takes the command and its bucket (None but for bucket commands)."""


def _fewest_over_ranks(count: int) -> int:
    """The smallest ``count`` over the rollout ranks (their default world)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return count
    value = torch.tensor([count])
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value)


def serve(bridge: tuple) -> int:
    """The whole life of a rollout rank: build the engine when told, serve until told to stop."""
    return RolloutServer(bridge).serve()
