"""Reuse a rank's item list across saves while the tensors it views are unchanged.

Building the items (Megatron's ``sharded_state_dict``, factories, optimizer slices) is pure
Python work inside the training loop's blocking window. Items are live views, so the same
list stays correct as long as every tensor they view is still the one the model and the
optimizer hold. The fingerprint checks exactly that (identity, address, shape and dtype of
every parameter, buffer, main parameter and optimizer state tensor); a list is reused only
when each item's storage is one of those tensors' storages, so a view of anything else (a
tensor computed by ``sharded_state_dict``) is never cached. The cached views keep the old
storages alive, so a new tensor can never reuse an old address and look unchanged.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional, Sequence

import torch

from megatron_rl.checkpoint.items import Item
from megatron_rl.checkpoint.optimizer_state import state_tensors


def _tensors(model: Sequence[torch.nn.Module], optimizer) -> list[torch.Tensor]:
    # nn.Module's own methods: Megatron's DDP wrapper has a ``buffers`` attribute (its grad buffers)
    out = [t for c in model for t in (*torch.nn.Module.parameters(c), *torch.nn.Module.buffers(c))]
    if optimizer is not None:
        out.extend(state_tensors(optimizer))
    return out


def _fingerprint(tensors: list[torch.Tensor]) -> tuple:
    return tuple((id(t), t.data_ptr(), tuple(t.shape), t.dtype) for t in tensors)


class ItemCache:
    """The last (model, optimizer)'s items, returned again while the fingerprint holds."""

    def __init__(self) -> None:
        self._owners: Optional[tuple] = None  # weak references to the model chunks and optimizer
        self._fingerprint: Optional[tuple] = None
        self._items: Optional[list[Item]] = None

    def clear(self, *_) -> None:
        self._owners = self._fingerprint = self._items = None

    def _same_owners(self, model, optimizer) -> bool:
        if self._owners is None:
            return False
        refs, optimizer_ref = self._owners
        same_model = len(refs) == len(model) and all(r() is c for r, c in zip(refs, model))
        return same_model and (optimizer_ref() if optimizer_ref is not None else None) is optimizer

    def get(self, model: Sequence[torch.nn.Module], optimizer, build: Callable[[], list[Item]]) -> list[Item]:
        tensors = _tensors(model, optimizer)
        fingerprint = _fingerprint(tensors)
        if self._items is not None and self._fingerprint == fingerprint and self._same_owners(model, optimizer):
            return self._items
        self.clear()
        items = build()
        tensors = _tensors(model, optimizer)  # again: building may create optimizer state
        storages = {t.untyped_storage().data_ptr() for t in tensors}
        if all(i.data.untyped_storage().data_ptr() in storages for i in items):
            # a dying owner drops the cache, so the views do not keep its memory alive
            refs = [weakref.ref(c, self.clear) for c in model]
            optimizer_ref = weakref.ref(optimizer, self.clear) if optimizer is not None else None
            self._owners, self._fingerprint, self._items = (refs, optimizer_ref), _fingerprint(tensors), items
        return items
