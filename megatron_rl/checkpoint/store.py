"""The checkpointer: the collective save / load that ties planning, writing and reading together.

A :class:`Checkpointer` owns everything a save keeps for the next one: the item list of the
last model and optimizer, per checkpoint root the cached plan and host buffers, the saves in
flight, the gate that holds optimizer updates for a deferred snapshot, the checkpoint
process group and the background writer thread. The trainer (and each tool that saves)
makes one and passes it where it saves; two checkpointers in a process share nothing.
Reading a finished checkpoint in one process needs none of that (:func:`iter_model_tensors`).
"""

from __future__ import annotations

import collections
import json
import shutil
import threading
import warnings
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.checkpoint import format as fmt
from megatron_rl.checkpoint import rng
from megatron_rl.checkpoint.collectives import CheckpointGroup
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
from megatron_rl.checkpoint.writer import BackgroundWriter, HostBuffers, SaveHandle, commit, write_rank

COMMIT_TIMEOUT_S = 1800.0
_LAYOUT_FIELDS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)
SNAPSHOTS = ("at_save", "before_update")
"""When an async save copies the state: inside ``save()`` (the call blocks for the copy),
or in the background before the next optimizer update (``save()`` returns at once, queued
behind the saves in flight; the update waits if the copy is not done yet). Sync saves write
from the live tensors."""


def layout_of(chunks: Sequence[torch.nn.Module]) -> dict:
    """World size and Megatron parallel sizes (recorded for information; restores RNG)."""
    config = unwrap(chunks[0]).config
    return {"world_size": _world()[1], **{f: getattr(config, f, None) for f in _LAYOUT_FIELDS}}


def _collect(chunks, optimizer, trainable_only: bool = False) -> list[Item]:
    items, pieces_of = model_items(model_sharded_state_dict(chunks))
    if trainable_only:
        items = trainable_items(chunks, pieces_of)
    if optimizer is not None:
        items = items + optimizer_items(optimizer, pieces_of)
    return dedup_local(items)


def trainable_items(chunks, pieces_of: dict) -> list[Item]:
    """The model's items that view a parameter with ``requires_grad`` (a LoRA run's adapters,
    and a critic's value head): what a checkpoint of a frozen base's run holds."""
    return [
        piece.item
        for chunk in chunks
        for param in chunk.parameters()
        if param.requires_grad
        for piece in pieces_of.get(id(param), ())
    ]


def _check_snapshot(snapshot: str, async_save: bool, guarded: bool) -> None:
    if snapshot not in SNAPSHOTS:
        raise ValueError(f"snapshot={snapshot!r} is not one of {list(SNAPSHOTS)}")
    if snapshot == "before_update" and not async_save:
        raise ValueError("snapshot='before_update' needs async_save=True (a sync save writes before it returns)")
    if snapshot == "before_update" and not guarded:
        raise ValueError(
            "snapshot='before_update' needs the optimizer whose step() changes the saved tensors "
            "(its updates wait for the copy); without one use snapshot='at_save'"
        )


def _check_save_args(step, extra, keep_last) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be None (keep all) or an int >= 1, got {keep_last!r}")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra must be a JSON-serialisable dict ({e})") from e


def _without_aliases(items: list[Item], record: dict) -> tuple[list[Item], dict]:
    """Items that alias another item's bytes are not written: the record lists them instead."""
    aliases = {i.name: i.alias_of for i in items if i.alias_of is not None}
    return [i for i in items if i.alias_of is None], dict(record, aliases=aliases)


def _share(plan, items: list[Item], rank: int) -> list[Item]:
    """The items ``plan`` has this rank write, in file order."""
    return sorted((i for i in items if plan.writers[i.key] == rank), key=lambda i: i.key)


def _clean_tmp(root: Path, step: int, rank: int) -> None:
    """Rank 0: make the root, drop the temporary of a save of ``step`` that died (never
    committed, so safe to discard)."""
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        tmp = fmt.tmp_dir(root, step)
        if tmp.exists():
            shutil.rmtree(tmp)


class Checkpointer:
    """Saves and loads checkpoints (collective), keeping what the next save reuses.

    Cheap to make: the checkpoint group and the writer thread start at the first save that
    needs them. :meth:`close` (or leaving a ``with`` block) waits for the saves in flight and
    stops the thread; a closed checkpointer starts afresh if it saves again.
    """

    def __init__(self) -> None:
        self._items = ItemCache()
        self._trainable_items = ItemCache()
        # Per checkpoint root: a trainer saves actor and critic under two roots, each with its own
        # chunk list, so one shared plan or buffer set would be replaced at every save.
        self._plans: dict[str, PlanCache] = collections.defaultdict(PlanCache)
        self._buffers: dict[str, HostBuffers] = collections.defaultdict(HostBuffers)
        self._pending: list[SaveHandle] = []
        self._gate = UpdateGate()
        self._group = CheckpointGroup()
        self._writer: Optional[BackgroundWriter] = None

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # another rank may be gone: waiting for a commit could hang; the writer finishes what it has
            self._release(wait=False)

    def close(self) -> None:
        """Wait until every save in flight is committed (raises the first failure), then stop
        the writer thread, unhook the optimizers and free the host buffers."""
        try:
            self.wait_pending()
        finally:
            self._release(wait=True)

    def _release(self, wait: bool) -> None:
        if self._writer is not None:
            self._writer.stop(wait=wait)
            self._writer = None
        self._gate.release()
        self._group.forget()
        self._items.clear()
        self._trainable_items.clear()
        self._plans.clear()
        self._buffers.clear()

    def _background(self) -> BackgroundWriter:
        """The writer thread, started on first use (and again in a forked child)."""
        if self._writer is None or not self._writer.usable():
            self._writer = BackgroundWriter()
        return self._writer

    def wait_snapshot(self) -> float:
        """Block until a deferred snapshot in flight has copied the state (call before changing
        saved tensors other than through the optimizer's step); returns the seconds waited."""
        return self._gate.wait()

    def snapshot_wait_seconds(self) -> float:
        """Total time optimizer updates (and wait_snapshot) waited for this checkpointer's
        deferred snapshots."""
        return self._gate.waited_s

    def wait_pending(self) -> None:
        """Block until every save in flight is committed (raises the first failure)."""
        handles, self._pending = self._pending, []
        errors = []
        for handle in handles:
            try:
                handle.wait()
            except fmt.CheckpointError as err:
                errors.append(err)
        if errors:
            raise errors[0]

    def _reap_finished(self) -> None:
        """Forget the saves in flight whose work is done; raise if one of them failed."""
        failed = [h for h in self._pending if h.failed()]
        self._pending = [h for h in self._pending if not h.done()]
        for handle in failed:
            handle.wait()  # raises its error

    def save(
        self,
        root,
        step: int,
        model,
        optimizer=None,
        extra: Optional[dict] = None,
        async_save: bool = False,
        keep_last: Optional[int] = None,
        snapshot: str = "at_save",
        trainable_only: bool = False,
    ) -> SaveHandle:
        """Collective. Save model chunks (+ distributed optimizer, RNG, ``extra``) as ``step``;
        ``trainable_only``: only the parameters that train (a frozen base is not saved).

        With ``async_save`` the call returns after the host copy (``snapshot="at_save"``) or at
        once (``"before_update"``: the copy runs in the background and ``optimizer``'s next
        step waits for it, see :data:`SNAPSHOTS`); ``handle.wait()`` (or the next save/load)
        blocks until the step is committed. A save first waits for the saves in flight to
        commit, except a deferred one, which queues behind them.
        """
        extra = {} if extra is None else extra
        _check_save_args(step, extra, keep_last)
        _check_snapshot(snapshot, async_save, guarded=optimizer is not None)
        cache = self._trainable_items if trainable_only else self._items
        items = cache.get(model, optimizer, lambda: _collect(model, optimizer, trainable_only))
        record = {"rng": rng.capture(), "optimizer": common_state(optimizer) if optimizer is not None else None}
        header = {"extra": extra, "layout": layout_of(model)}
        guard = [sub.optimizer for sub in sub_optimizers(optimizer)] if optimizer is not None else []
        return self.save_items(root, step, items, header, record, async_save, keep_last, snapshot, guard)

    def save_items(
        self,
        root,
        step: int,
        items: list[Item],
        header: dict,
        record: dict,
        async_save: bool = False,
        keep_last: Optional[int] = None,
        snapshot: str = "at_save",
        guard: Sequence[torch.optim.Optimizer] = (),
    ) -> SaveHandle:
        """Collective. Plan, snapshot and write ``items`` (boxes of canonical tensors) as ``step``.

        ``header`` ({extra, layout}) goes into the metadata once; ``record`` ({rng, optimizer})
        once per rank. :meth:`save` builds both from a Megatron model and optimizer.

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
        _check_snapshot(snapshot, async_save, guarded=bool(guard))
        deferred = async_save and snapshot == "before_update"
        if deferred:
            self._reap_finished()
        else:
            self.wait_pending()
        root = Path(root)
        rank, world = _world()
        if world > 1:
            self._group.get()  # created on this thread, where every rank creates its groups in order
        plans, buffers = self._plans[str(root.absolute())], self._buffers[str(root.absolute())]
        items, record = _without_aliases(dedup_local(items), record)
        infos = [i.info() for i in items]
        own = digest(infos)

        def held_share() -> list[Item]:
            guess = plans.guess(rank, own)
            return _share(guess, items, rank) if guess is not None else items

        copied: dict[ChunkKey, torch.Tensor] = {}
        gathered = None
        if deferred:
            done = threading.Event()
            after = torch.cuda.current_stream().record_event() if any(i.data.is_cuda for i in items) else None
            self._gate.hold(guard, done)
        else:
            _clean_tmp(root, step, rank)
            if async_save:
                copied = buffers.snapshot(held_share())
            # issued after rank 0's cleanup: once it completes, the directory is clean, so the writers start then
            gathered = self._group.start_digest_gather(own)

        def work() -> None:
            nonlocal gathered
            if deferred:
                try:
                    copied.update(buffers.snapshot(held_share(), after=after))
                finally:
                    done.set()  # a failed copy must not hold training forever; wait() reports it
                _clean_tmp(root, step, rank)
                gathered = self._group.start_digest_gather(own)
            buffers.release_retired()
            digests = gathered()
            plan = plans.get(digests)
            if plan is None:
                plan = balanced_plan(self._group.gather_objects(infos))
                plans.put(digests, plan)
            mine = _share(plan, items, rank)
            tensors = _from_snapshot(copied, mine) if async_save else [i.data for i in mine]
            tmp = fmt.tmp_dir(root, step)
            tmp.mkdir(parents=True, exist_ok=True)
            write_rank(tmp, rank, mine, tensors, record)
            if rank == 0:
                commit(root, step, world, header, keep_last, COMMIT_TIMEOUT_S)

        writer = self._background() if async_save else None
        handle = SaveHandle(work, root, step, rank, COMMIT_TIMEOUT_S, writer)
        if async_save:
            self._pending.append(handle)
        return handle

    def load(
        self,
        root,
        model,
        optimizer=None,
        step: Optional[int] = None,
        restore_rng: bool = True,
        trainable_only: bool = False,
        only: Optional[Callable[[str], bool]] = None,
    ) -> dict:
        """Collective. Load ``step`` (default: newest committed) into ``model`` chunks in any layout
        (and the distributed optimizer, and RNG when the layout is the saving one and
        ``restore_rng``: a run reading another run's model, a reward model, keeps its own
        random streams); returns ``extra``. ``trainable_only``: only the parameters that train
        (the rest, a frozen base, stays as loaded before); ``only``: only the tensors whose
        canonical names it accepts (a critic's backbone from a policy's checkpoint)."""
        self.wait_pending()
        if _world()[1] > 1:
            dist.barrier()  # every rank's pending save is committed before anyone looks
        root = Path(root)
        step = _agreed_step(root, step)
        metadata = fmt.read_metadata(root, step)
        directory = fmt.step_dir(root, step)
        items, pieces_of = model_items(model_sharded_state_dict(model))
        if trainable_only:
            items = trainable_items(model, pieces_of)
        if only is not None:
            items = [i for i in items if only(i.name)]
        with Reader(directory, metadata) as reader:
            reader.fill(dedup_local(items))
            if optimizer is not None:
                for sub in sub_optimizers(optimizer):
                    ensure_state(sub)
                load_common_state(optimizer, metadata.optimizer)  # before taking views: it may re-wrap state
                # state that aliases the model's memory (fp32 main params) was filled just above
                reader.fill([i for i in dedup_local(optimizer_items(optimizer, pieces_of)) if i.alias_of is None])
        if restore_rng:
            _restore_rng(metadata, model)
        return json.loads(json.dumps(metadata.extra))


def _restore_rng(metadata, model) -> None:
    """This rank's saved RNG states, when the checkpoint was saved in the model's layout."""
    rank, _ = _world()
    if metadata.layout == layout_of(model) and str(rank) in metadata.rng:
        rng.restore(metadata.rng[str(rank)])
    else:
        warnings.warn(
            f"checkpoint layout {metadata.layout} differs from {layout_of(model)}: RNG states not restored",
            stacklevel=3,  # the caller of load()
        )


def _from_snapshot(snapshot: dict, mine: list[Item]) -> list[torch.Tensor]:
    missing = [i.key for i in mine if i.key not in snapshot]
    if missing:  # only when other ranks' lists changed while this one's did not
        raise fmt.CheckpointError(
            f"the save plan changed on other ranks after this rank copied its usual share; {len(missing)} chunk(s) "
            f"to write were not copied (first: {missing[0].name} at {list(missing[0].offsets)}). "
            "Save again: the new plan is cached now"
        )
    return [snapshot[i.key] for i in mine]


def _agreed_step(root: Path, step: Optional[int]) -> int:
    """Rank 0 decides which committed step to load; everyone gets its answer or its error."""
    rank, world = _world()
    answer: list = [None]
    if rank == 0:
        try:
            answer[0] = fmt.resolve_step(root, step)
        except fmt.CheckpointError as err:
            answer[0] = str(err)
    if world > 1:
        dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], str):
        raise fmt.CheckpointError(answer[0])
    return answer[0]


def iter_model_tensors(root, step: Optional[int] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Single process, no Megatron: (canonical name, full tensor) of every model tensor."""
    root = Path(root)
    step = fmt.resolve_step(root, step)
    yield from iter_tensors(fmt.step_dir(root, step), fmt.read_metadata(root, step))
