"""The distributed optimizer's state as layout-free boxes, and its non-tensor state as JSON.

Megatron's DistributedOptimizer keeps, per parameter, a flat slice [start, end) of the
parameter's local (TP/EP-sharded) shard: the fp32 main parameter, exp_avg and exp_avg_sq.
Megatron 0.16.1 can describe these slices as ShardedTensors only by gathering them on DP
rank 0 ('fully_reshardable'); its gather-free 'fully_sharded_model_space' needs
``ShardedTensor.flattened_range``, which 0.16.1 rejects. So we read the same structures that
format reads (``gbuf_ranges``, and the slices through
:func:`megatron_rl.platform.megatron_internals.main_param_and_optimizer_states`) and cut each flat
slice into row-major boxes of the model tensor, named
``optimizer.<exp_avg|exp_avg_sq|fp32_param>.<canonical parameter name>``: every DP rank
writes its own slice, and any layout can read them back.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch

from megatron_rl.checkpoint.boxes import flat_range_boxes, volume
from megatron_rl.checkpoint.format import CheckpointError, decode, encode
from megatron_rl.checkpoint.items import Item, ParamPiece
from megatron_rl.platform.megatron_internals import main_param_and_optimizer_states

STATE_NAMES = {
    "param": "fp32_param",
    "exp_avg": "exp_avg",
    "exp_avg_sq": "exp_avg_sq",
    "max_exp_avg_sq": "max_exp_avg_sq",
}


def sub_optimizers(optimizer) -> list:
    """The DistributedOptimizers inside ``optimizer`` (a ChainedOptimizer for MoE models)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    subs = getattr(optimizer, "chained_optimizers", None)
    subs = list(subs) if subs is not None else [optimizer]
    for sub in subs:
        if not isinstance(sub, DistributedOptimizer):
            raise TypeError(
                f"checkpoint supports Megatron's DistributedOptimizer (use_distributed_optimizer=True),"
                f" alone or in a ChainedOptimizer; got {type(sub).__name__}"
            )
        if sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            raise TypeError("checkpoint does not support use_precision_aware_optimizer (state is stored scaled)")
    return [s for s in subs if not getattr(s, "is_stub_optimizer", False)]


def ensure_state(sub) -> None:
    """Give every parameter Adam state (zeros, step 0) before the first step.

    torch's Adam creates state lazily in ``step()``; a checkpoint saved or loaded before
    then needs the tensors to exist. Zero moments at step 0 are exactly what Adam's first
    step would create, so training continues identically.
    """
    inner = sub.optimizer
    if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(
            f"checkpoint supports torch Adam/AdamW inside the DistributedOptimizer; got {type(inner).__name__}"
        )
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in inner.param_groups:
        for param in group["params"]:
            state = inner.state[param]
            if state:
                continue
            state["step"] = torch.zeros((), dtype=scalar)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def state_tensors(optimizer) -> list[torch.Tensor]:
    """Every main parameter and tensor state the inner optimizers hold (cache fingerprints)."""
    out = []
    for sub in sub_optimizers(optimizer):
        inner = sub.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                out.append(param)
                out.extend(v for v in inner.state.get(param, {}).values() if isinstance(v, torch.Tensor))
    return out


def _param_ranges(sub):
    """(model parameter, its flat [start, end) held by this DP rank) in Megatron's order."""
    for gbuf_range_maps in sub.gbuf_ranges:
        for per_bucket in gbuf_range_maps.values():
            for bucket in per_bucket:
                for param, ranges in bucket["param_map"].items():
                    yield param, ranges["param"].start, ranges["param"].end


def optimizer_items(optimizer, pieces_of: dict[int, list[ParamPiece]]) -> list[Item]:
    """Boxes of every tensor state this rank's optimizer slices hold (live views)."""
    items: list[Item] = []
    for sub in sub_optimizers(optimizer):
        ensure_state(sub)
        for param, start, end in _param_ranges(sub):
            pieces = pieces_of.get(id(param))
            if pieces is None:
                raise CheckpointError("an optimizer parameter is missing from the model's sharded_state_dict")
            for state_key, flat in main_param_and_optimizer_states(sub, param).items():
                if state_key == "step":
                    continue  # a scalar kept in the param groups (non-tensor state)
                if state_key not in STATE_NAMES:
                    raise CheckpointError(f"unknown optimizer state {state_key!r}; known: {sorted(STATE_NAMES)}")
                flat = flat.view(-1)
                if flat.numel() != end - start:
                    raise CheckpointError(
                        f"optimizer state {state_key} has {flat.numel()} elements for a range of {end - start}"
                    )
                for piece in pieces:
                    items.extend(_boxes_of_slice(STATE_NAMES[state_key], flat, start, end, piece))
    return items


def _aliases_model(flat: torch.Tensor, start: int, piece: ParamPiece) -> bool:
    """True when the flat state slice (parameter elements from ``start``) is the model piece's
    own memory: an fp32 model's main parameters are views of its parameters."""
    shard = piece.item.data
    expected = shard.data_ptr() + (start - piece.start) * shard.element_size()
    return flat.dtype == shard.dtype and flat.data_ptr() == expected


def _boxes_of_slice(state: str, flat: torch.Tensor, start: int, end: int, piece: ParamPiece) -> list[Item]:
    shard = piece.item
    lo, hi = max(start, piece.start), min(end, piece.start + shard.data.numel())
    out = []
    if lo >= hi:
        return out
    alias_of = shard.name if state == "fp32_param" and _aliases_model(flat, start, piece) else None
    for box_flat, (offsets, shape) in flat_range_boxes(shard.data.shape, lo - piece.start, hi - piece.start):
        first = piece.start + box_flat - start
        out.append(
            Item(
                name=f"optimizer.{state}.{shard.name}",
                global_shape=shard.global_shape,
                offsets=tuple(o + p for o, p in zip(offsets, shard.offsets)),
                data=flat[first : first + volume(shape)].view(shape),
                allow_shape_mismatch=shard.allow_shape_mismatch,
                alias_of=alias_of,
            )
        )
    return out


# --- non-tensor state ------------------------------------------------------------------


def _group_id(group: dict) -> tuple:
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    return tuple(group.get(k, group.get(f"pre_{k}")) for k in param_group_identifier_keys)


def common_state(optimizer) -> dict:
    """This rank's param groups (hyper-parameters and step) and grad scaler, JSON-encoded."""
    groups, scaler = [], None
    for sub in sub_optimizers(optimizer):
        ensure_state(sub)
        state = sub.state_dict()
        groups.extend(state["optimizer"]["param_groups"])
        if scaler is None and "grad_scaler" in state:
            scaler = state["grad_scaler"]
    return {"param_groups": encode(groups), "grad_scaler": encode(scaler)}


def merge_common_states(per_rank: list[Optional[dict]]) -> Optional[dict]:
    """One entry per distinct param group (ranks of different stages may hold different ones)."""
    present = [s for s in per_rank if s is not None]
    if not present:
        return None
    merged, seen = [], set()
    for state in present:
        for group in decode(state["param_groups"]):
            gid = _group_id(group)
            if gid not in seen:
                seen.add(gid)
                merged.append(group)
    return {"param_groups": encode(merged), "grad_scaler": present[0]["grad_scaler"]}


def load_common_state(optimizer, saved: Optional[dict]) -> None:
    """Restore param groups (step, lr, ...) and grad scaler; tensor state is loaded beside."""
    if saved is None:
        raise CheckpointError("the checkpoint holds no optimizer state, but an optimizer was given to load")
    groups, scaler = decode(saved["param_groups"]), decode(saved["grad_scaler"])
    for sub in sub_optimizers(optimizer):
        state = {"optimizer": {"param_groups": _with_expert_twins(groups, sub.optimizer.param_groups)}}
        if scaler is not None and sub.grad_scaler is not None:
            state["grad_scaler"] = scaler
        try:
            sub.load_state_dict(state)
        except KeyError as e:
            known = sorted({_group_id(g) for g in groups}, key=str)
            raise CheckpointError(f"optimizer param group {e} is not in the checkpoint; saved groups: {known}") from e
        _unshare_steps(sub)


def _with_expert_twins(saved: list[dict], live: list[dict]) -> list[dict]:
    """The saved param groups, plus a relabelled copy for each live group that differs from a
    saved one only in ``is_expert_parallel``.

    Megatron puts expert weights in groups of their own only when EP > 1 (below it they are
    reduced like dense weights), so a checkpoint saved at EP1 has no expert group, and Megatron
    matches groups by their identifier keys: loading it at EP2 would fail although the
    hyper-parameters and step of the expert group are the dense group's."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    flag = param_group_identifier_keys.index("is_expert_parallel")
    out = copy.deepcopy(saved)
    known = {_group_id(g) for g in saved}
    for group in live:
        gid = _group_id(group)
        if gid in known:
            continue
        twin = next(
            (g for g in saved if _group_id(g)[:flag] + _group_id(g)[flag + 1 :] == gid[:flag] + gid[flag + 1 :]), None
        )
        if twin is not None:
            relabelled = copy.deepcopy(twin)
            key = "is_expert_parallel" if "is_expert_parallel" in twin else "pre_is_expert_parallel"
            relabelled[key] = gid[flag]
            out.append(relabelled)
            known.add(gid)
    return out


def _unshare_steps(sub) -> None:
    """Give every parameter its own Adam step tensor.

    Megatron 0.16.1 DistributedOptimizer.load_state_dict (torch-optimizer path, i.e. without
    Apex/TE) assigns ONE step tensor to every parameter's state; torch Adam increments each
    parameter's step in place, so after a load the shared step advanced once per parameter
    per iteration and the bias correction was wrong from the second step on.
    """
    for state in sub.optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()
