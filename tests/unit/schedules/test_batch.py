"""TrainBatch layout (prediction-aligned), packing helpers, splits and validation."""

import pytest
import torch

from megatron_rl.schedules import Microbatching, TrainBatch, gather_response, pack_sequences, scatter_response


def test_pack_aligns_loss_mask_with_the_predicted_response_tokens():
    tokens, mask = pack_sequences([[5, 6], [1]], [[7, 8, 9], [2]], seq_length=6, pad_token_id=0)
    assert tokens.tolist() == [[5, 6, 7, 8, 9, 0], [1, 2, 0, 0, 0, 0]]
    # position t predicts token t + 1: row 0 predicts 7, 8, 9 from positions 1, 2, 3
    assert mask.tolist() == [[False, True, True, True, False, False], [True, False, False, False, False, False]]
    batch = TrainBatch(tokens=tokens, loss_mask=mask)
    assert batch.labels[0][mask[0]].tolist() == [7, 8, 9]
    assert batch.labels[1][mask[1]].tolist() == [2]
    assert batch.labels[:, -1].tolist() == [0, 0]  # repeats the last token: a valid id


def test_scatter_and_gather_response_round_trip():
    logprobs = [torch.tensor([-0.1, -0.2, -0.3]), torch.tensor([-0.5])]
    placed = scatter_response(logprobs, prompt_lengths=[2, 1], seq_length=6)
    assert placed[0].tolist() == pytest.approx([0, -0.1, -0.2, -0.3, 0, 0])
    assert placed[1].tolist() == pytest.approx([-0.5, 0, 0, 0, 0, 0])
    back = gather_response(placed, prompt_lengths=[2, 1], response_lengths=[3, 1])
    assert [b.tolist() for b in back] == [pytest.approx(x.tolist()) for x in logprobs]


def _batch(n=8, s=5):
    tokens = torch.arange(n * s).reshape(n, s)
    mask = torch.zeros(n, s, dtype=torch.bool)
    mask[:, 1:3] = True
    return TrainBatch(tokens=tokens, loss_mask=mask, advantages=torch.randn(n, s), is_positive=torch.arange(n) % 2 == 0)


def test_padded_placement_is_contiguous_dp_slices_and_microbatches():
    batch, micro = _batch(), Microbatching(micro_batch_size=2)
    part = batch.select(micro.rank_rows(batch, dp_rank=1, dp_size=2))
    assert part.tokens[:, 0].tolist() == [20, 25, 30, 35]
    assert part.is_positive.tolist() == [True, False, True, False]
    assert part.old_logprobs is None  # absent fields stay absent
    bins = micro.bins(part)
    assert bins == [[0, 1], [2, 3]]
    chunks = micro.micro_batches(part, bins, len(bins))
    assert [m.tokens[:, 0].tolist() for m in chunks] == [[20, 25], [30, 35]]
    torch.testing.assert_close(chunks[1].advantages, batch.advantages[6:8])


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda b: Microbatching().rank_rows(b, 0, 3), "does not split over data_parallel_size=3"),
        (lambda b: Microbatching(micro_batch_size=3).bins(b), "micro_batch_size=3 must divide"),
        (lambda b: Microbatching(micro_batch_size=0), "micro_batch_size=0 must be >= 1"),
        (lambda b: b.require("old_logprobs", "advantages"), r"needs batch fields \['old_logprobs'\]"),
        (lambda b: TrainBatch(tokens=b.tokens, loss_mask=b.loss_mask[:, :4]), "loss_mask must have the shape"),
        (lambda b: TrainBatch(tokens=b.tokens.float(), loss_mask=b.loss_mask), "int64"),
        (
            lambda b: TrainBatch(tokens=b.tokens, loss_mask=torch.ones_like(b.loss_mask)),
            r"loss_mask\[:, -1\] must be 0",
        ),
        (
            lambda b: TrainBatch(tokens=b.tokens, loss_mask=b.loss_mask, is_positive=torch.ones(3)),
            "is_positive must be",
        ),
        (lambda b: pack_sequences([[1, 2]], [[3, 4, 5]], seq_length=4), "fit seq_length=4"),
        (lambda b: pack_sequences([[]], [[3]], seq_length=4), "non-empty"),
    ],
)
def test_bad_input_raises_naming_it(build, match):
    with pytest.raises(ValueError, match=match):
        build(_batch())


def test_epoch_order_is_a_fixed_permutation_and_select_moves_every_field():
    from megatron_rl.schedules import epoch_order

    order = epoch_order(8, seed=3, step=5, epoch=0)
    assert sorted(order.tolist()) == list(range(8))
    assert order.tolist() == epoch_order(8, seed=3, step=5, epoch=0).tolist()  # every rank, every resume
    others = [epoch_order(8, seed=s, step=t, epoch=e).tolist() for s, t, e in ((4, 5, 0), (3, 6, 0), (3, 5, 1))]
    assert all(o != order.tolist() for o in others)
    batch = _batch()
    moved = batch.select(order)
    for row, source in enumerate(order.tolist()):
        assert moved.tokens[row].tolist() == batch.tokens[source].tolist()
        assert moved.advantages[row].tolist() == batch.advantages[source].tolist()
        assert bool(moved.is_positive[row]) == bool(batch.is_positive[source])
