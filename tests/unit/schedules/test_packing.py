"""schedules.packing: placement (balanced DP split, first-fit-decreasing bins, equal
micro-batch counts), and the packed row and its way back to rows, against hand-worked examples."""

import pytest
import torch

from megatron_rl.schedules import Microbatching, PackedMicroBatch, TrainBatch, pack_sequences
from megatron_rl.schedules.packing import balanced_bins, balanced_partition, first_fit_decreasing


def batch_of(lengths, seq=8):
    """Rows of the given lengths (prompt 1 token), tokens 10·row + position."""
    prompts = [[10 * n] for n in range(len(lengths))]
    responses = [[10 * n + t for t in range(1, length)] for n, length in enumerate(lengths)]
    tokens, mask = pack_sequences(prompts, responses, seq)
    return TrainBatch(
        tokens=tokens, loss_mask=mask, lengths=torch.tensor(lengths), temperature=torch.full((len(lengths), seq), 0.5)
    )


def test_balanced_partition_equal_sizes_and_loads():
    # longest first to the least-loaded rank with room: 7->0, 6->1, 5->1 (6<7), 4->0 ... by hand
    assert balanced_partition([7, 6, 5, 4], 2) == [[0, 3], [1, 2]]  # loads 11 and 11
    # 9->0, 1->1, 2->2, 3->1 (tie with 2: lower index), 4->2, 5->0 (the only one with room)
    assert balanced_partition([9, 1, 1, 1, 1, 1], 3) == [[0, 5], [1, 3], [2, 4]]
    with pytest.raises(ValueError, match="5 sequences do not split evenly over 2"):
        balanced_partition([1] * 5, 2)


def test_first_fit_decreasing_bins():
    lengths = [5, 3, 4, 2, 6]
    # 6 -> bin0; 5 -> bin1; 4 -> bin0 (6+4=10); 3 -> bin1 (8); 2 -> bin1 (10)
    assert first_fit_decreasing(lengths, range(5), 10) == [[4, 2], [0, 1, 3]]
    with pytest.raises(ValueError, match="a sequence of 6 tokens does not fit max_tokens_per_micro_batch=5"):
        first_fit_decreasing(lengths, range(5), 5)


def test_balanced_bins_use_as_few_bins_as_fit_with_even_loads():
    lengths = [9, 2, 2, 2, 2, 2, 2, 2]  # 23 tokens, capacity 16
    assert first_fit_decreasing(lengths, range(8), 16) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # loads 15 and 8
    # two bins, longest first into the least loaded: 9 | 2,2,2,2,2 (10) | then 9+2, 10+2
    assert balanced_bins(lengths, range(8), 16) == [[0, 6], [1, 2, 3, 4, 5, 7]]  # loads 11 and 12
    # 3 x 6 in capacity 8: ceil(18/8) = 3 bins
    assert balanced_bins([6, 6, 6], range(3), 8) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="a sequence of 9 tokens does not fit"):
        balanced_bins(lengths, range(8), 8)


def test_packed_row_layout_and_round_trip():
    batch = batch_of([3, 5, 2]).columns(5)
    mb = PackedMicroBatch(batch, padded_length=12)
    assert mb.cu_seqlens.tolist() == [0, 3, 8, 10, 12]  # the tail is its own segment
    assert mb.tokens[0, :10].tolist() == [0, 1, 2, 10, 11, 12, 13, 14, 20, 21]
    assert mb.position_ids[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 0, 1]
    assert mb.max_seqlen == 5
    assert mb.temperature[0].tolist() == [0.5] * 10 + [1.0, 1.0]
    values = torch.arange(12.0)[None, :, None]
    rows = mb.as_rows(values)[..., 0]
    assert rows.tolist() == [[0, 1, 2, 0, 0], [3, 4, 5, 6, 7], [8, 9, 0, 0, 0]]
    assert torch.equal(mb.pack(rows, fill=-1.0)[0], torch.tensor([*range(10), -1, -1], dtype=torch.float))


def test_a_cp_packed_row_gives_every_sequence_a_slot_of_2cp_chunks():
    """sequence_multiple=4 (CP2): lengths 3, 5, 2 take slots of 4, 8, 4; padding ends each slot."""
    batch = batch_of([3, 5, 2]).columns(5)
    mb = PackedMicroBatch(batch, padded_length=20, sequence_multiple=4)
    assert mb.segment_lengths() == [4, 8, 4, 4]
    assert mb.cu_seqlens.tolist() == [0, 4, 12, 16, 20]
    assert mb.tokens[0].tolist() == [0, 1, 2, 0, 10, 11, 12, 13, 14, 0, 0, 0, 20, 21, 0, 0, 0, 0, 0, 0]
    assert mb.position_ids[0, :12].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]
    rows = mb.as_rows(torch.arange(20.0)[None, :, None])[..., 0]
    assert rows.tolist() == [[0, 1, 2, 0, 0], [4, 5, 6, 7, 8], [12, 13, 0, 0, 0]]
    with pytest.raises(ValueError, match="padded_length=12 < the 16 positions of its sequences"):
        PackedMicroBatch(batch, padded_length=12, sequence_multiple=4)


def test_for_layout_under_cp_pads_sequences_to_2cp_tp_and_bins_by_slots():
    micro = Microbatching(max_tokens=16).for_layout(2, interleaved=False, cp_size=2)
    assert (micro.multiple, micro.sequence_multiple) == (8, 8)
    local = batch_of([3, 5, 2, 7])
    bins = micro.bins(local)  # every sequence takes 8 positions: two per 16-token row
    assert sorted(len(b) for b in bins) == [2, 2]
    assert micro.row_lengths(local, bins) == [16, 16]
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=12 must be a positive multiple of 8"):
        Microbatching(max_tokens=12).for_layout(2, interleaved=False, cp_size=2)


def test_as_rows_is_differentiable():
    mb = PackedMicroBatch(batch_of([2, 3]).columns(3), padded_length=6)
    y = torch.ones(1, 6, requires_grad=True)
    (mb.as_rows(y) * torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])).sum().backward()
    assert y.grad[0].tolist() == [1, 2, 4, 5, 6, 0]  # row 0 positions 0-1, row 1 positions 0-2


def test_microbatching_rank_rows_bins_and_padding_to_count():
    batch = batch_of([8, 1, 2, 7, 3, 3])
    micro = Microbatching(max_tokens=8, multiple=2)
    rank0, rank1 = (micro.rank_rows(batch, r, 2).tolist() for r in (0, 1))
    # 8->0, 7->1, 3(row 4)->1, 3(row 5)->0, 2->1 (10 < 11), 1->0: loads 12 and 12
    assert (rank0, rank1) == ([0, 1, 5], [2, 3, 4])
    assert micro.gather_order(batch, 2).tolist() == [0, 1, 5, 2, 3, 4]
    local = batch.select(torch.tensor(rank0))
    bins = micro.bins(local)
    assert bins == [[0], [2, 1]]  # 8 alone; 3 + 1
    mbs = micro.micro_batches(local, bins, count=3)
    assert [m.num_rows for m in mbs] == [1, 2, 0]  # one empty micro-batch to match a DP peer
    assert [m.padded_length for m in mbs] == [8, 4, 2]  # 3 + 1 rounded up to 2; empty: 2
    uniform = Microbatching(max_tokens=8, multiple=2, uniform_length=True)  # interleaved PP
    assert uniform.row_lengths(local, bins) == [8, 8]
    assert [m.padded_length for m in uniform.micro_batches(local, bins, 3, length=10)] == [10, 10, 10]


def test_padded_microbatching_is_the_contiguous_split():
    batch = batch_of([3] * 8)
    micro = Microbatching(micro_batch_size=2)
    assert micro.rank_rows(batch, 1, 2).tolist() == [4, 5, 6, 7]
    assert micro.bins(batch.rows(0, 4)) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="micro_batch_size=3 must divide this rank's 4 rows"):
        Microbatching(micro_batch_size=3).bins(batch.rows(0, 4))


def test_budget_must_be_a_multiple_of_the_layout():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=9 must be a positive multiple of 2"):
        Microbatching(max_tokens=9, multiple=2)


def test_lengths_are_checked():
    tokens, mask = pack_sequences([[1]], [[2, 3]], 4)
    with pytest.raises(ValueError, match=r"lengths must lie in \[1, S=4\], got \[5, 5\]"):
        TrainBatch(tokens=tokens, loss_mask=mask, lengths=torch.tensor([5]))


def test_cost_counts_padding_and_empty_micro_batches():
    batch = batch_of([8, 1, 2, 7, 3, 3])  # 24 real tokens; ranks hold [8, 1, 3] and [2, 7, 3]
    packed = Microbatching(max_tokens=8, multiple=2)
    # rank 0: [8], [3+1 -> 4]; rank 1: [7 -> 8], [3+2 -> 6]: 26 computed tokens
    assert packed.cost(batch, 2) == {
        "real_tokens": 24,
        "computed_tokens": 26,
        "micro_batches": 2,
        "tokens_per_micro_batch_max": 8,
    }
    # the interleaved schedule pads every row of the call to the longest (8): 4 x 8
    uniform = Microbatching(max_tokens=8).for_layout(2, interleaved=True)
    assert uniform == Microbatching(max_tokens=8, multiple=2, uniform_length=True)
    assert uniform.cost(batch, 2)["computed_tokens"] == 32
    padded = Microbatching(micro_batch_size=1)
    assert padded.cost(batch, 2) == {
        "real_tokens": 24,
        "computed_tokens": 48,
        "micro_batches": 3,
        "tokens_per_micro_batch_max": 8,
    }


def test_groups_of_rows_stay_together_and_in_order_on_one_rank_and_in_one_micro_batch():
    """A preference pair (group_size=2) is never split: the DP split and the packed bins
    place whole groups, weighed by their summed lengths, each group's rows in order."""
    lengths = torch.tensor([9, 2, 3, 3, 8, 8, 1, 1, 5, 6, 2, 2])
    batch = TrainBatch(
        tokens=torch.zeros(12, 10, dtype=torch.long), loss_mask=torch.zeros(12, 10, dtype=torch.bool), lengths=lengths
    )
    micro = Microbatching(micro_batch_size=2, max_tokens=16, group_size=2)
    for rows in micro.dp_split(batch, 2):
        rows = rows.tolist()
        assert len(rows) == 6 and all(rows[i] % 2 == 0 and rows[i + 1] == rows[i] + 1 for i in range(0, 6, 2))
        for b in micro.bins(batch.select(torch.tensor(rows))):
            assert all(b[i] % 2 == 0 and b[i + 1] == b[i] + 1 for i in range(0, len(b), 2)), b
    padded = Microbatching(micro_batch_size=4, group_size=2)
    assert padded.bins(batch.rows(0, 8)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="multiple of group_size=2"):
        Microbatching(micro_batch_size=3, group_size=2)
    with pytest.raises(ValueError, match="in groups of 2"):
        micro.dp_split(batch.rows(0, 6), 2)
