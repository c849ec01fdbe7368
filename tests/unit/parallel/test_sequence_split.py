"""parallel.sequence_split: Megatron's load-balanced CP split as index tensors, by hand."""

import pytest
import torch

from megatron_rl.parallel.config import sequence_multiple
from megatron_rl.parallel.sequence_split import gather_source, local_positions, row_order


def test_a_padded_row_gives_each_rank_an_early_and_a_late_chunk():
    # 8 positions, CP2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert local_positions([8], 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions([8], 2, 1).tolist() == [2, 3, 4, 5]
    # CP4 on 16 positions: rank 1 holds chunks 1 and 6
    assert local_positions([16], 4, 1).tolist() == [2, 3, 12, 13]


def test_a_packed_row_splits_each_sequence_on_its_own():
    # sequences of 8 and 4 positions at CP2: chunks of 2 and 1, in row order
    assert local_positions([8, 4], 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert local_positions([8, 4], 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    order = row_order([8, 4], 2)
    assert order.tolist() == [0, 1, 6, 7, 8, 11, 2, 3, 4, 5, 9, 10]
    assert torch.equal(order.sort().values, torch.arange(12))  # every position exactly once


def test_a_sequence_that_does_not_split_into_2cp_chunks_is_refused():
    with pytest.raises(ValueError, match="a sequence of 6 positions does not split into 2·CP = 4 chunks"):
        local_positions([8, 6], 2, 0)


def test_sequence_multiple_is_2cp_times_tp_under_sequence_parallelism():
    assert sequence_multiple(1) == 1 and sequence_multiple(1, 2) == 2
    assert sequence_multiple(2) == 4 and sequence_multiple(2, 2) == 8 and sequence_multiple(4, 2) == 16


def test_gather_source_puts_the_gathered_entries_back_in_row_order():
    source = gather_source((8, 4), 2)
    assert source.tolist() == [0, 1, 6, 7, 8, 9, 2, 3, 4, 10, 11, 5]
    gathered = row_order([8, 4], 2)  # each gathered entry is its row position
    assert torch.equal(gathered.index_select(0, source), torch.arange(12))
