"""vLLM on rollout ranks of their own: the training side's client, the rollout side's server.

With ``rollout.placement: disaggregated`` the engines live on the rollout ranks
(:mod:`megatron_rl.launch.roles`). The trainer talks to them through a
:class:`RolloutClient`, which offers what the trainer uses of a colocated engine (``config``,
the weight-sync calls ``load_weights`` / ``check_weights`` / ``finish_weight_update``,
``prompt_logprobs`` for the parity guard) plus ``generate_groups``. Every training rank
makes every call, in lockstep; training rank 0 alone talks over the bridge and the results
every rank needs are broadcast over the training world.

The rollout ranks run :func:`serve`: receive a command, run it on their engines exactly as
a colocated launch of their size would (prompts dealt to the replicas and gathered back,
:mod:`megatron_rl.rollout.replicas`), and rollout rank 0 answers. Weights arrive as one
byte tensor per bucket, broadcast over the bridge from the HF-layout export the colocated
sync loads, so the same in-place loader and weight check run on the rollout side. A
command that fails on the rollout side is answered with its error, raised on the training
ranks as :class:`RolloutRankError`, and ends the rollout rank's process too.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch

from megatron_rl.data import PromptBatch
from megatron_rl.rollout.channel import ROLLOUT_LEADER, TRAINER, Channel
from megatron_rl.rollout.engine import EngineConfig, Sample, Sampling


class RolloutRankError(RuntimeError):
    """A command failed on a rollout rank; the message names the rank and the error."""


@dataclasses.dataclass(frozen=True)
class Command:
    kind: str
    """start | generate | logprobs | load | check | finish | stop"""
    payload: Any = None


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


ALIGN = 8
"""Every tensor starts at a multiple of this many bytes, so each can be viewed in its dtype."""


def _layout(specs: Sequence[TensorSpec]) -> tuple[list[tuple[int, int]], int]:
    """(offset, bytes) of every tensor in the byte buffer, and the buffer's size."""
    slots, offset = [], 0
    for spec in specs:
        size = int(torch.Size(spec.shape).numel()) * torch.empty(0, dtype=spec.dtype).element_size()
        slots.append((offset, size))
        offset += -(-size // ALIGN) * ALIGN
    return slots, offset


def pack_bucket(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[TensorSpec], torch.Tensor]:
    """One byte tensor holding every tensor of a bucket, and what to cut it back into."""
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in named]
    slots, total = _layout(specs)
    flat = torch.zeros(total, dtype=torch.uint8)
    for (_, tensor), (offset, size) in zip(named, slots):
        flat[offset: offset + size] = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return specs, flat


def unpack_bucket(specs: Sequence[TensorSpec], flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views into ``flat`` with the names, shapes and dtypes of :func:`pack_bucket`."""
    slots, _ = _layout(specs)
    return [(spec.name, flat[offset: offset + size].view(spec.dtype).reshape(spec.shape))
            for spec, (offset, size) in zip(specs, slots)]


def bucket_bytes(specs: Sequence[TensorSpec]) -> int:
    """The size of the byte tensor that carries a bucket of ``specs``."""
    return _layout(specs)[1]


class RolloutClient:
    """The training ranks' handle on the rollout ranks' engines (see the module docstring).

    ``channel``: the bridge on training rank 0, None on the other training ranks."""

    def __init__(self, channel: Optional[Channel], config: EngineConfig, model_dir: Path):
        self.channel, self.config = channel, config
        started = time.perf_counter()
        self._request(Command("start", (str(model_dir), config)))
        self.build_s = time.perf_counter() - started
        """Seconds until every rollout rank had its engine (the rollout side builds them)."""

    # -- generation -------------------------------------------------------------------

    def generate_groups(self, prompts: PromptBatch, sampling: Sampling) -> list[list[Sample]]:
        """``sampling.n`` samples per prompt, generated on the rollout ranks, on every training rank."""
        return self._request(Command("generate", (prompts, sampling)))

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        return self._request(Command("logprobs", [list(s) for s in sequences]))

    # -- weights ----------------------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
        """Send one bucket to every rollout rank, which loads it (training rank 0 sends; the
        others hold the same bucket and do nothing)."""
        if self.channel is None:
            return "remote"
        return self._exchange(Command("load"), list(named_tensors))

    def check_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]):
        """What the rollout ranks serve for a bucket, read back and compared with it (merged over
        the rollout ranks), on every training rank."""
        return self._request(Command("check"), list(named_tensors))

    def finish_weight_update(self) -> None:
        self._request(Command("finish"))

    def close(self) -> None:
        """Release the rollout ranks (their processes end with the launch)."""
        if self.channel is not None:
            self.channel.broadcast_object(Command("stop"))

    # -- transport --------------------------------------------------------------------

    def _request(self, command: Command, bucket: Optional[list] = None) -> Any:
        """Training rank 0 asks, every training rank gets the answer (collective over the training world)."""
        import torch.distributed as dist

        answer = [self._exchange(command, bucket) if self.channel is not None else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(answer, src=0)
        return answer[0]

    def _exchange(self, command: Command, bucket: Optional[list] = None) -> Any:
        if bucket is not None:
            specs, flat = pack_bucket(bucket)
            command = Command(command.kind, specs)
        self.channel.broadcast_object(command)
        if bucket is not None:
            self.channel.broadcast_tensor(flat)
        status, value = self.channel.recv_object(ROLLOUT_LEADER)
        if status == "error":
            raise RolloutRankError(value)
        return value


class RolloutServer:
    """The rollout side: one engine per rank (replicas and engine TP as in a colocated launch
    of the rollout ranks' size), driven by the trainer's commands."""

    def __init__(self, channel: Channel):
        import torch.distributed as dist

        self.channel, self.engine = channel, None
        self.rank = dist.get_rank()
        self.served = 0

    def serve(self) -> int:
        """Run commands until ``stop``; returns how many were served."""
        while True:
            command = self.channel.broadcast_object(root=TRAINER)
            if command.kind == "stop":
                return self.served
            bucket = None
            if command.kind in ("load", "check"):
                flat = torch.empty(bucket_bytes(command.payload), dtype=torch.uint8)
                bucket = unpack_bucket(command.payload, self.channel.broadcast_tensor(flat, TRAINER))
            try:
                value = self._run(command, bucket)
            except Exception as err:
                if self.channel.rank == ROLLOUT_LEADER:
                    self.channel.send_object(("error", f"rollout rank {self.rank}: {type(err).__name__}: {err}"),
                                             TRAINER)
                raise
            if self.channel.rank == ROLLOUT_LEADER:
                self.channel.send_object(("ok", value), TRAINER)
            self.served += 1

    def _run(self, command: Command, bucket: Optional[list]) -> Any:
        kind = command.kind
        if kind == "start":
            from megatron_rl.rollout.engine import RolloutEngine

            model_dir, config = command.payload
            self.engine = RolloutEngine(model_dir, config)
            return None
        if kind == "generate":
            from megatron_rl.rollout.replicas import generate_groups

            prompts, sampling = command.payload
            return generate_groups(self.engine, prompts, sampling)
        if kind == "logprobs":
            return self.engine.prompt_logprobs(command.payload)
        if kind == "load":
            return self.engine.load_weights(bucket)
        if kind == "check":
            return self._merged_check(bucket)
        if kind == "finish":
            return self.engine.finish_weight_update()
        raise ValueError(f"unknown rollout command {kind!r}")

    def _merged_check(self, bucket: list):
        """Every rollout rank reads back its own engine; the results merged over the rollout world."""
        import torch.distributed as dist

        from megatron_rl.rollout.weight_check import WeightCheckResult

        mine = self.engine.check_weights(bucket)
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        merged = WeightCheckResult()
        for result in everyone:
            merged = merged.merged(result)
        return merged


def serve(channel: Channel) -> int:
    """The whole life of a rollout rank: build the engine when told, serve until told to stop."""
    return RolloutServer(channel).serve()
