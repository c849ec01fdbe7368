"""The item cache: reused only while every viewed tensor is the one the model holds."""

import gc

import torch

from megatron_rl.checkpoint.item_cache import ItemCache
from megatron_rl.checkpoint.items import Item


def _build(model, calls):
    def build():
        calls.append(1)
        w = model[0].weight
        return [Item("w", tuple(w.shape), (0, 0), w.data)]

    return build


def test_reused_while_unchanged_rebuilt_when_a_tensor_is_replaced():
    model, calls, cache = [torch.nn.Linear(4, 3)], [], ItemCache()
    first = cache.get(model, None, _build(model, calls))
    with torch.no_grad():
        model[0].weight.add_(1.0)  # in-place updates (optimizer steps) keep the views valid
    assert cache.get(model, None, _build(model, calls)) is first and len(calls) == 1
    model[0].weight.data = torch.zeros(3, 4)  # a new tensor: the cached view is stale
    again = cache.get(model, None, _build(model, calls))
    assert len(calls) == 2 and again[0].data.data_ptr() == model[0].weight.data_ptr()
    other = [torch.nn.Linear(4, 3)]
    assert cache.get(other, None, _build(other, calls))[0].data.data_ptr() == other[0].weight.data_ptr()
    assert len(calls) == 3


def test_views_of_other_tensors_are_never_cached():
    model, calls, cache = [torch.nn.Linear(4, 3)], [], ItemCache()

    def computed():
        calls.append(1)
        return [Item("w", (3, 4), (0, 0), model[0].weight.detach() * 2)]

    cache.get(model, None, computed)
    cache.get(model, None, computed)
    assert len(calls) == 2


def test_a_dead_model_releases_the_cache():
    model, calls, cache = [torch.nn.Linear(4, 3)], [], ItemCache()
    cache.get(model, None, _build(model, calls))
    del model
    gc.collect()
    assert cache._items is None
