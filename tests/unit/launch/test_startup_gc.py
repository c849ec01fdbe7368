"""The collector paused through a rank's start: no automatic collection while paused; at the
resume the garbage made meanwhile is collected, what lives is frozen, and collections run
again; a resume without a pause changes nothing. The freeze before vLLM's build collects
the garbage before it freezes the rest."""

import gc
import weakref

import pytest

from megatron_rl.launch import startup_gc


class _Node:
    pass


def _cycle():
    node = _Node()
    node.self = node
    return weakref.ref(node)


@pytest.fixture
def collector_restored():
    yield
    gc.enable()
    gc.unfreeze()


def test_a_paused_start_collects_its_garbage_and_freezes_the_rest_at_the_resume(collector_restored):
    startup_gc.pause()
    assert not gc.isenabled()
    kept = _Node()
    made_while_paused = _cycle()
    grown = [_Node() for _ in range(3 * gc.get_threshold()[0])]  # enough to trigger collections
    assert made_while_paused() is not None and grown  # none ran
    frozen_before = gc.get_freeze_count()
    startup_gc.resume()
    assert gc.isenabled() and made_while_paused() is None
    assert gc.get_freeze_count() > frozen_before
    assert all(obj is not kept for obj in gc.get_objects(generation=2))  # frozen: in no generation
    made_after = _cycle()
    gc.collect()
    assert made_after() is None


def test_a_resume_without_a_pause_changes_nothing(collector_restored):
    frozen_before = gc.get_freeze_count()
    startup_gc.resume()
    assert gc.isenabled() and gc.get_freeze_count() == frozen_before


def test_the_heap_is_frozen_after_its_garbage_is_collected(collector_restored):
    """What lives is frozen (the engine build's collections skip it); a garbage cycle made
    before is collected, not kept for good; a cycle made after is collected as usual."""
    kept = _Node()
    made_before = _cycle()
    startup_gc.freeze_heap()
    assert made_before() is None and gc.get_freeze_count() > 0
    assert all(obj is not kept for obj in gc.get_objects(generation=2))  # frozen: in no generation
    made_after = _cycle()
    gc.collect()
    assert made_after() is None
