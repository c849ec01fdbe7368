"""Box arithmetic and save planning: pure functions, checked against brute force / by hand."""

import pytest
import torch

from megatron_rl.checkpoint import boxes as bx
from megatron_rl.checkpoint.planner import ChunkInfo, ChunkKey, PlanCache, balanced_plan, digest


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 5), (1, 1, 4), (4, 1, 3)])
def test_flat_range_boxes_cover_exactly_and_are_contiguous(shape):
    n = bx.volume(shape)
    index = torch.arange(n).view(shape)
    for start in range(n + 1):
        for end in range(start, n + 1):
            seen = []
            for flat, box in bx.flat_range_boxes(shape, start, end):
                values = index[bx.as_slices(box)].reshape(-1)
                # each box is one run of consecutive flat indices starting where it says
                assert torch.equal(values, torch.arange(flat, flat + values.numel()))
                seen.append(values)
            got = torch.cat(seen) if seen else torch.empty(0, dtype=torch.long)
            assert torch.equal(got, torch.arange(start, end)), (shape, start, end)
            assert len(seen) <= 2 * len(shape) - 1


def test_flat_range_boxes_rejects_out_of_range():
    with pytest.raises(ValueError, match="outside a tensor of shape"):
        bx.flat_range_boxes((2, 3), 0, 7)


def test_intersect_relative_and_span():
    a, b = ((0, 2), (4, 4)), ((2, 0), (4, 3))
    assert bx.intersect(a, b) == ((2, 2), (2, 1))
    assert bx.intersect(a, ((4, 0), (1, 1))) is None
    assert bx.relative(((2, 2), (2, 1)), (2, 0)) == ((0, 2), (2, 1))
    # rows 0..1, column 2 of a 4x3 container: flat 2 and 5
    assert bx.flat_span(((0, 2), (2, 1)), (4, 3)) == (2, 6)
    assert not bx.disjoint([a, b]) and bx.disjoint([a, ((4, 0), (1, 1))])


def _info(name, offset, nbytes):
    return ChunkInfo(ChunkKey(name, (offset,), (nbytes // 4,)), (100,), "float32", nbytes)


def test_balanced_plan_writes_each_chunk_once_largest_first_to_least_loaded():
    # rank 0 and 1 both hold A (40 B) and B (24 B); rank 1 alone holds C (16 B); rank 2 holds B.
    a, b, c = _info("a", 0, 40), _info("b", 0, 24), _info("c", 0, 16)
    plan = balanced_plan([[a, b], [a, b, c], [b]])
    # A -> rank 0 (tie, lowest rank); B -> rank 1 (load 0 vs rank 2's 0: lowest); C -> rank 1
    assert plan.writers == {a.key: 0, b.key: 1, c.key: 1}
    assert plan.bytes_per_rank == [40, 40, 0]
    plan = balanced_plan([[a, b], [a, b], [b]])
    assert plan.writers == {a.key: 0, b.key: 1} and plan.bytes_per_rank == [40, 24, 0]


def test_plan_rejects_ranks_that_disagree_on_a_tensor():
    a = _info("a", 0, 40)
    other = ChunkInfo(ChunkKey("a", (10,), (10,)), (200,), "float32", 40)
    with pytest.raises(ValueError, match="tensor 'a': rank 0 holds shape \\[100\\]"):
        balanced_plan([[a], [other]])


def test_digest_changes_with_the_chunk_list():
    a, b = _info("a", 0, 40), _info("a", 10, 40)
    assert digest([a]) == digest([a]) != digest([b])


def test_plan_cache_guesses_from_the_own_digest_and_confirms_with_all():
    plan = balanced_plan([[ChunkInfo(ChunkKey("w", (0,), (4,)), (4,), "float32", 16)]])
    cache = PlanCache()
    assert cache.guess(0, "a") is None
    cache.put(["a", "b"], plan)
    assert cache.guess(0, "a") is plan and cache.guess(1, "b") is plan
    assert cache.guess(1, "a") is None and cache.guess(2, "a") is None  # own list changed / new rank
    assert cache.get(["a", "b"]) is plan and cache.get(["a", "c"]) is None  # another rank's changed
