"""save / load: the collective entry points that tie planning, writing and reading together."""

from __future__ import annotations

import collections
import json
import shutil
import threading
import warnings
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.checkpoint import format as fmt
from megatron_rl.checkpoint import rng
from megatron_rl.checkpoint.collectives import checkpoint_group, gather_objects, start_digest_gather
from megatron_rl.checkpoint.collectives import world as _world
from megatron_rl.checkpoint.item_cache import ItemCache
from megatron_rl.checkpoint.items import Item, dedup_local, model_items, model_sharded_state_dict, unwrap
from megatron_rl.checkpoint.optimizer_state import (
    common_state,
    ensure_state,
    load_common_state,
    optimizer_items,
    sub_optimizers,
)
from megatron_rl.checkpoint.planner import ChunkKey, PlanCache, balanced_plan, digest
from megatron_rl.checkpoint.reader import Reader, iter_tensors
from megatron_rl.checkpoint.update_gate import UpdateGate
from megatron_rl.checkpoint.writer import HostBuffers, SaveHandle, commit, write_rank

COMMIT_TIMEOUT_S = 1800.0
_LAYOUT_FIELDS = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
)

_items = ItemCache()
# Per checkpoint root: a trainer saves actor and critic under two roots, each with its own
# chunk list, so one shared plan or buffer set would be replaced at every save.
_plans: dict[str, PlanCache] = collections.defaultdict(PlanCache)
_buffers: dict[str, HostBuffers] = collections.defaultdict(HostBuffers)
_pending: list[SaveHandle] = []
_gate = UpdateGate()
SNAPSHOTS = ("at_save", "before_update")
"""When an async save copies the state: inside ``save()`` (the call blocks for the copy),
or in the background before the next optimizer update (``save()`` returns at once, queued
behind the saves in flight; the update waits if the copy is not done yet). Sync saves write
from the live tensors."""


def layout_of(chunks: Sequence[torch.nn.Module]) -> dict:
    """World size and Megatron parallel sizes (recorded for information; restores RNG)."""
    config = unwrap(chunks[0]).config
    return {"world_size": _world()[1], **{f: getattr(config, f, None) for f in _LAYOUT_FIELDS}}


def _collect(chunks, optimizer) -> list[Item]:
    items, pieces_of = model_items(model_sharded_state_dict(chunks))
    if optimizer is not None:
        items = items + optimizer_items(optimizer, pieces_of)
    return dedup_local(items)


def wait_snapshot() -> float:
    """Block until a deferred snapshot in flight has copied the state (call before changing
    saved tensors other than through the optimizer's step); returns the seconds waited."""
    return _gate.wait()


def snapshot_wait_seconds() -> float:
    """Total time optimizer updates (and wait_snapshot) waited for deferred snapshots."""
    return _gate.waited_s


def wait_pending() -> None:
    """Block until every save in flight is committed (raises the first failure)."""
    global _pending
    handles, _pending = _pending, []
    errors = []
    for handle in handles:
        try:
            handle.wait()
        except fmt.CheckpointError as err:
            errors.append(err)
    if errors:
        raise errors[0]


def _reap_finished() -> None:
    """Forget the saves in flight whose work is done; raise if one of them failed."""
    global _pending
    failed = [h for h in _pending if h.failed()]
    _pending = [h for h in _pending if not h.done()]
    for handle in failed:
        handle.wait()  # raises its error


def _check_snapshot(snapshot: str, async_save: bool, guarded: bool) -> None:
    if snapshot not in SNAPSHOTS:
        raise ValueError(f"snapshot={snapshot!r} is not one of {list(SNAPSHOTS)}")
    if snapshot == "before_update" and not async_save:
        raise ValueError("snapshot='before_update' needs async_save=True (a sync save writes before it returns)")
    if snapshot == "before_update" and not guarded:
        raise ValueError("snapshot='before_update' needs the optimizer whose step() changes the saved tensors "
                         "(its updates wait for the copy); without one use snapshot='at_save'")


def _check_save_args(step, extra, keep_last) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be None (keep all) or an int >= 1, got {keep_last!r}")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra must be a JSON-serialisable dict ({e})") from e


def save(root, step: int, model, optimizer=None, extra: Optional[dict] = None,
         async_save: bool = False, keep_last: Optional[int] = None, snapshot: str = "at_save") -> SaveHandle:
    """Collective. Save model chunks (+ distributed optimizer, RNG, ``extra``) as ``step``.

    With ``async_save`` the call returns after the host copy (``snapshot="at_save"``) or at
    once (``"before_update"``: the copy runs in the background and ``optimizer``'s next
    step waits for it, see :data:`SNAPSHOTS`); ``handle.wait()`` (or the next save/load)
    blocks until the step is committed. A save first waits for the saves in flight to
    commit, except a deferred one, which queues behind them.
    """
    extra = {} if extra is None else extra
    _check_save_args(step, extra, keep_last)
    _check_snapshot(snapshot, async_save, guarded=optimizer is not None)
    items = _items.get(model, optimizer, lambda: _collect(model, optimizer))
    record = {"rng": rng.capture(), "optimizer": common_state(optimizer) if optimizer is not None else None}
    header = {"extra": extra, "layout": layout_of(model)}
    guard = [sub.optimizer for sub in sub_optimizers(optimizer)] if optimizer is not None else []
    return save_items(root, step, items, header, record, async_save, keep_last, snapshot, guard)


def save_items(root, step: int, items: list[Item], header: dict, record: dict,
               async_save: bool = False, keep_last: Optional[int] = None, snapshot: str = "at_save",
               guard: Sequence[torch.optim.Optimizer] = ()) -> SaveHandle:
    """Collective. Plan, snapshot and write ``items`` (boxes of canonical tensors) as ``step``.

    ``header`` ({extra, layout}) goes into the metadata once; ``record`` ({rng, optimizer})
    once per rank. :func:`save` builds both from a Megatron model and optimizer.

    Blocking part of an async save: wait for the saves in flight, list the items, copy this
    rank's share into host buffers, issue the digest exchange. Its result is awaited on the
    background thread, which then writes and (rank 0) commits. The share comes from the plan
    cached at the previous save of ``root`` when this rank's own list is unchanged (the steady
    state); otherwise every held item is copied, so whatever the new plan assigns is in the
    snapshot.

    ``snapshot="before_update"``: none of that blocks. The save queues behind those in
    flight on the one writer thread, which copies first (the ``guard`` optimizers' next
    ``step()`` waits until it has), then cleans, exchanges digests and writes. All
    checkpoint-group collectives of queued saves thus run on that thread, in order.
    """
    global _pending
    _check_snapshot(snapshot, async_save, guarded=bool(guard))
    deferred = async_save and snapshot == "before_update"
    if deferred:
        _reap_finished()
    else:
        wait_pending()
    root = Path(root)
    rank, world = _world()
    if world > 1:
        checkpoint_group()  # created on this thread, where every rank creates its groups in order
    tmp = fmt.tmp_dir(root, step)
    plans, buffers = _plans[str(root.absolute())], _buffers[str(root.absolute())]

    def clean() -> None:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by a save that died: never committed, safe to discard
                shutil.rmtree(tmp)

    items = dedup_local(items)
    aliases = {i.name: i.alias_of for i in items if i.alias_of is not None}
    items = [i for i in items if i.alias_of is None]
    record = dict(record, aliases=aliases)
    infos = [i.info() for i in items]
    own = digest(infos)
    share = lambda plan: sorted((i for i in items if plan.writers[i.key] == rank), key=lambda i: i.key)

    def held_share() -> list[Item]:
        guess = plans.guess(rank, own)
        return share(guess) if guess is not None else items

    copied: dict[ChunkKey, torch.Tensor] = {}
    gathered = None
    if deferred:
        done = threading.Event()
        after = torch.cuda.current_stream().record_event() if any(i.data.is_cuda for i in items) else None
        _gate.hold(guard, done)
    else:
        clean()
        if async_save:
            copied = buffers.snapshot(held_share())
        # issued after rank 0's cleanup: once it completes, the directory is clean, so the writers start then
        gathered = start_digest_gather(own)

    def work() -> None:
        nonlocal gathered
        if deferred:
            try:
                copied.update(buffers.snapshot(held_share(), after=after))
            finally:
                done.set()  # a failed copy must not hold training forever; wait() reports it
            clean()
            gathered = start_digest_gather(own)
        buffers.release_retired()
        digests = gathered()
        plan = plans.get(digests)
        if plan is None:
            plan = balanced_plan(gather_objects(infos))
            plans.put(digests, plan)
        mine = share(plan)
        tensors = _from_snapshot(copied, mine) if async_save else [i.data for i in mine]
        tmp.mkdir(parents=True, exist_ok=True)
        write_rank(tmp, rank, mine, tensors, record)
        if rank == 0:
            commit(root, step, world, header, keep_last, COMMIT_TIMEOUT_S)

    handle = SaveHandle(work, root, step, rank, COMMIT_TIMEOUT_S, background=async_save)
    if async_save:
        _pending.append(handle)
    return handle


def _from_snapshot(snapshot: dict, mine: list[Item]) -> list[torch.Tensor]:
    missing = [i.key for i in mine if i.key not in snapshot]
    if missing:  # only when other ranks' lists changed while this one's did not
        raise fmt.CheckpointError(
            f"the save plan changed on other ranks after this rank copied its usual share; {len(missing)} chunk(s) "
            f"to write were not copied (first: {missing[0].name} at {list(missing[0].offsets)}). Save again: the new plan is cached now"
        )
    return [snapshot[i.key] for i in mine]


def _agreed_step(root: Path, step: Optional[int]) -> int:
    """Rank 0 decides which committed step to load; everyone gets its answer or its error."""
    rank, world = _world()
    answer: list = [None]
    if rank == 0:
        if step is None:
            found = fmt.latest_step(root)
            answer[0] = found if found is not None else f"no committed checkpoint under {root}"
        elif step in fmt.committed_steps(root):
            answer[0] = step
        else:
            answer[0] = f"step {step} is not a committed checkpoint under {root}; committed: {fmt.committed_steps(root)}"
    if world > 1:
        dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], str):
        raise fmt.CheckpointError(answer[0])
    return answer[0]


def load(root, model, optimizer=None, step: Optional[int] = None) -> dict:
    """Collective. Load ``step`` (default: newest committed) into ``model`` chunks in any layout
    (and the distributed optimizer, and RNG when the layout is the saving one); returns ``extra``."""
    wait_pending()
    if _world()[1] > 1:
        dist.barrier()  # every rank's pending save is committed before anyone looks
    root = Path(root)
    step = _agreed_step(root, step)
    metadata = fmt.read_metadata(root, step)
    directory = fmt.step_dir(root, step)
    items, pieces_of = model_items(model_sharded_state_dict(model))
    with Reader(directory, metadata) as reader:
        reader.fill(dedup_local(items))
        if optimizer is not None:
            for sub in sub_optimizers(optimizer):
                ensure_state(sub)
            load_common_state(optimizer, metadata.optimizer)  # before taking views: it may re-wrap state
            # state that aliases the model's memory (fp32 main params) was filled just above
            reader.fill([i for i in dedup_local(optimizer_items(optimizer, pieces_of)) if i.alias_of is None])
    rank, _ = _world()
    if metadata.layout == layout_of(model) and str(rank) in metadata.rng:
        rng.restore(metadata.rng[str(rank)])
    else:
        warnings.warn(f"checkpoint layout {metadata.layout} differs from {layout_of(model)}: RNG states not restored")
    return json.loads(json.dumps(metadata.extra))


def iter_model_tensors(root, step: Optional[int] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Single process, no Megatron: (canonical name, full tensor) of every model tensor."""
    root = Path(root)
    if step is None:
        step = fmt.latest_step(root)
        if step is None:
            raise fmt.CheckpointError(f"no committed checkpoint under {root}")
    yield from iter_tensors(fmt.step_dir(root, step), fmt.read_metadata(root, step))
