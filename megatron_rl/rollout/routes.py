"""The experts vLLM's MoE routers chose for every token it computed, per sample (R3).

Router replay trains the MoE actor on the routes the rollout used. vLLM 0.32 can return
them itself (``enable_return_routed_experts``), but only with its V2 model runner, which
needs Triton and does not start on CPU. Its routers take a capture callback in every
runner, though (``BaseRouter.set_capture_fn``, what its own capturer binds), so a
:class:`RouteRecorder` on each worker binds one per MoE layer and wraps the runner's model
forward (:func:`megatron_rl.platform.vllm_internals.wrap_model_forward`): before a
forward it notes which request each row of the batch belongs to and at which position
(``input_batch.req_ids``, ``query_start_loc``, ``positions``), after it files every
layer's top-k ids under (request, position).

Positions are those of the sample's tokens as inputs: a sample of prompt P and response R
is routed at positions 0 .. P + R - 2 (the last sampled token is never fed back). A
position vLLM did not compute (a prefix-cache hit) stays -1; the trainer's replay falls
back to Megatron's own router there and counts it. Written against vLLM 0.32.0's worker
(eager mode: a captured CUDA graph would skip the callbacks).
"""

from __future__ import annotations

import re
from functools import partial
from typing import Optional

import torch

from megatron_rl.platform.vllm_internals import wrap_model_forward

_CHILD = re.compile(r"^(?:(\d+)_)?(.+)-[0-9a-zA-Z]{8}$")
"""vLLM's internal request ids: ``<external>-<8 random chars>``, and ``<i>_<that>`` for the
i-th of n samples of one prompt (v1/engine/input_processor.py, parallel_sampling.py)."""


def request_key(internal_id: str) -> tuple[str, int]:
    """(external request id, sample index) of a vLLM worker's request id."""
    match = _CHILD.match(internal_id)
    if match is None:
        raise ValueError(f"unexpected vLLM request id {internal_id!r}")
    return match.group(2), int(match.group(1) or 0)


class RouteRecorder:
    """Per worker: the routes of every (request, position) computed while recording."""

    def __init__(self, runner, num_layers: int, topk: int):
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        self.runner, self.num_layers, self.topk = runner, num_layers, topk
        self.recording = False
        self.routes: dict[str, torch.Tensor] = {}
        """Internal request id -> [positions, num_layers, topk] int16, -1 where not computed."""
        self._layers: dict[int, torch.Tensor] = {}
        bound = 0
        for module in runner.model.modules():
            if isinstance(module, MoERunner):
                module.router.set_capture_fn(partial(self._capture, module.layer_id))
                bound += 1
        if not bound:
            raise ValueError("route recording needs a MoE model; this one has no MoE layer")
        self._forward = wrap_model_forward(runner, self._model_forward)

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        if self.recording:
            self._layers[layer] = topk_ids.to(torch.int16, copy=True)

    def _model_forward(self, *args, **kwargs):
        if not self.recording:
            return self._forward(*args, **kwargs)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        num_reqs = self.runner.input_batch.num_reqs
        req_ids = list(self.runner.input_batch.req_ids[:num_reqs])
        starts = self.runner.query_start_loc.cpu[: num_reqs + 1].tolist()
        self._layers = {}
        out = self._forward(*args, **kwargs)
        self._file(req_ids, starts, positions.cpu())
        return out

    def _file(self, req_ids: list[str], starts: list[int], positions: torch.Tensor) -> None:
        tokens = starts[-1]
        batch = torch.full((tokens, self.num_layers, self.topk), -1, dtype=torch.int16)
        for layer, ids in self._layers.items():
            batch[:, layer] = ids[:tokens]
        for n, req in enumerate(req_ids):
            rows = slice(starts[n], starts[n + 1])
            where = positions[rows].long()
            if not len(where):
                continue
            table = self._table(req, int(where.max()) + 1)
            table[where] = batch[rows]

    def _table(self, req: str, length: int) -> torch.Tensor:
        table = self.routes.get(req)
        if table is None or table.shape[0] < length:
            grown = torch.full(
                (max(length, 2 * (0 if table is None else table.shape[0])), self.num_layers, self.topk),
                -1,
                dtype=torch.int16,
            )
            if table is not None:
                grown[: table.shape[0]] = table
            self.routes[req] = table = grown
        return table

    def take(self) -> dict[tuple[str, int], torch.Tensor]:
        """Everything recorded, by (external request id, sample index); then forget it."""
        out = {request_key(req): table for req, table in self.routes.items()}
        self.routes = {}
        return out


# -- worker-side entry points (collective_rpc on every vLLM worker) ----------------------

_ATTR = "_megatron_rl_route_recorder"


def start_on_worker(worker, num_layers: int, topk: int) -> None:
    """Record from now until :func:`take_on_worker` (binding the recorder once)."""
    runner = worker.model_runner
    recorder: Optional[RouteRecorder] = getattr(runner, _ATTR, None)
    if recorder is None:
        recorder = RouteRecorder(runner, num_layers, topk)
        setattr(runner, _ATTR, recorder)
    recorder.routes = {}
    recorder.recording = True


def take_on_worker(worker) -> dict[tuple[str, int], torch.Tensor]:
    recorder: RouteRecorder = getattr(worker.model_runner, _ATTR)
    recorder.recording = False
    return recorder.take()
