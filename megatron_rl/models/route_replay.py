"""Router replay (R3): the MoE actor's forward and backward use the experts vLLM chose.

Megatron-Core's router asks an optional ``router_replay`` object for its top-k
(``topk_routing_with_score_function``); Megatron's own ``RouterReplay`` keeps every
instance in a class-level list and is steered by process-wide switches. Here each actor
router gets its own :class:`LayerReplay` (no shared state: an actor, a critic and a
reference model in one process never see each other's routes), and the schedules hand
each model chunk the routes of the micro-batch it is about to run (:func:`set_targets`).

Per router call, a token's experts are the replayed ones where vLLM routed it, else the
router's own (prompt tokens vLLM took from its prefix cache, padding). The gate's
probabilities are recomputed from this forward's scores at the replayed experts, so the
router's weights still get gradients. Token order inside the router is Megatron's
[s, b] flattened s-major, on each tensor-parallel rank its own sequence chunk when
sequence parallelism is on; each pipeline stage (and virtual chunk) replays its own
layers by their global layer number.

Activation recompute (full, or selective of the MoE layer) runs a layer's forward again
during the backward pass, with grad enabled, while its first forward ran without: every
first forward of a recomputed layer queues its targets and each recompute takes the
oldest (per chunk, backward runs micro-batches in forward order).
"""

from __future__ import annotations

import collections
from typing import Optional, Sequence

import torch

_ATTR = "_megatron_rl_route_replay"


class LayerReplay:
    """One router's replay: targets for the next forward, a queue for recomputes, and
    counts of how often its own top-k agreed with the targets."""

    def __init__(self, layer_index: int, recompute: bool):
        self.layer_index, self.recompute = layer_index, recompute
        self.target: Optional[torch.Tensor] = None
        """[tokens, k] int64 for the next forward, -1 rows: the router's own choice."""
        self.replay = True
        """False: only count agreement, route by the router's own top-k."""
        self.pending: collections.deque = collections.deque()
        self.used: list[torch.Tensor] = []
        """The experts each forward used (only while ``record_used``)."""
        self.record_used = False
        self.agreed = self.compared = self.fallback = self.routed = 0

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        """Megatron's hook: (values, indices) of the top-k of ``scores`` [tokens, experts]."""
        own_values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        recomputing = self.recompute and torch.is_grad_enabled()
        target = (self.pending.popleft() if self.pending else None) if recomputing else self.target
        if not recomputing:
            if self.recompute and not torch.is_grad_enabled() and self.target is not None:
                self.pending.append(self.target)
            if target is not None:
                self._count(own, target)
        if target is None or not self.replay:
            chosen = own
        else:
            chosen = torch.where((target >= 0).all(-1, keepdim=True), target.to(own.device), own)
        if self.record_used and not recomputing:
            self.used.append(chosen.detach().cpu())
        if chosen is own:
            return own_values, own
        return scores.gather(1, chosen), chosen

    def _count(self, own: torch.Tensor, target: torch.Tensor) -> None:
        valid = (target >= 0).all(-1)
        same = (own.sort(-1).values == target.to(own.device).sort(-1).values).all(-1)
        self.agreed += int((same & valid).sum())
        self.compared += int(valid.sum())
        self.routed += int(valid.numel())
        self.fallback += int((~valid).sum())


class RouteReplay:
    """The :class:`LayerReplay` of every MoE router in ``chunks`` (one model's chunks on
    this rank); installed once, a pass-through while no targets are set."""

    def __init__(self, chunks: Sequence[torch.nn.Module]):
        from megatron.core.transformer.moe.router import TopKRouter

        self.layers: list[LayerReplay] = []
        for chunk in chunks:
            config = _unwrapped(chunk).config
            recompute = config.recompute_granularity == "full" or (
                config.recompute_granularity == "selective" and "moe" in (config.recompute_modules or ())
            )
            mine, tp_group = [], None
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    module.router_replay = LayerReplay(module.layer_number - 1, recompute)
                    mine.append(module.router_replay)
                    tp_group = module.tp_group
            split = config.sequence_parallel and tp_group is not None and tp_group.size() > 1
            setattr(_unwrapped(chunk), _ATTR, _ChunkReplay(mine, (tp_group.rank(), tp_group.size()) if split else None))
            self.layers += mine
        if not self.layers:
            raise ValueError("router replay needs a MoE model: no router in these chunks")

    def begin(self, replay: bool = True, record_used: bool = False) -> None:
        """Before a forward(-backward) pass over micro-batches: clear queues and counts;
        ``replay`` False only measures agreement."""
        for layer in self.layers:
            layer.pending.clear()
            layer.target = None
            layer.replay, layer.record_used, layer.used = replay, record_used, []
            layer.agreed = layer.compared = layer.fallback = layer.routed = 0

    def stats(self, reset: bool = True) -> dict[str, int]:
        """Sums over this rank's routers since :meth:`begin`: ``agreed`` of ``compared``
        (token, layer) pairs had the router's own top-k set equal to vLLM's; ``fallback`` of
        ``routed`` had no vLLM route."""
        out = {k: sum(getattr(layer, k) for layer in self.layers) for k in ("agreed", "compared", "fallback", "routed")}
        if reset:
            for layer in self.layers:
                layer.agreed = layer.compared = layer.fallback = layer.routed = 0
        return out


class _ChunkReplay:
    def __init__(self, layers: list[LayerReplay], sequence_split: Optional[tuple[int, int]]):
        self.layers, self.sequence_split = layers, sequence_split
        """(tp rank, tp size) when sequence parallelism gives each TP rank a chunk of s."""

    def set_targets(self, routes: Optional[torch.Tensor]) -> None:
        """``routes`` [b, s, num_layers, k] of one micro-batch (None: the routers' own)."""
        for layer in self.layers:
            layer.target = (
                None if routes is None else _router_order(routes[:, :, layer.layer_index], self.sequence_split)
            )


def _router_order(routes: torch.Tensor, sequence_split: Optional[tuple[int, int]]) -> torch.Tensor:
    """[b, s, k] -> [tokens, k] in the router's order: s-major; with sequence parallelism
    this tensor-parallel rank's chunk of s."""
    per_position = routes.transpose(0, 1)  # [s, b, k]
    if sequence_split is not None:
        rank, size = sequence_split
        chunk = per_position.shape[0] // size
        per_position = per_position[rank * chunk : (rank + 1) * chunk]
    return per_position.reshape(-1, per_position.shape[-1]).long()


def set_targets(chunk: torch.nn.Module, routes: Optional[torch.Tensor]) -> None:
    """Hand ``chunk``'s routers their micro-batch's routes (no-op without a replay)."""
    replay = getattr(_unwrapped(chunk), _ATTR, None)
    if replay is not None:
        replay.set_targets(routes)


def _unwrapped(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk
