"""Reward shaping (overlong penalty) and DAPO dynamic-sampling filter."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms import dynamic_sampling_keep, overlong_penalty


def test_overlong_penalty_by_hand():
    # max_len 20, buffer 5 → ramp from 15: l = 16 → −1/5, 18 → −3/5, 20 → −1, 25 → −1
    lengths = torch.tensor([10, 15, 16, 18, 20, 25])
    expected = torch.tensor([0.0, 0.0, -0.2, -0.6, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(lengths, 20, 5), expected)
    torch.testing.assert_close(overlong_penalty(lengths, 20, 5, factor=0.5), 0.5 * expected)


def test_overlong_penalty_dapo_constants():
    # DAPO: 20480 / 4096 → ramp starts at 16384; 18432 is half way → −0.5
    out = overlong_penalty(torch.tensor([16384, 18432, 20480, 30000]), 20480, 4096)
    torch.testing.assert_close(out, torch.tensor([0.0, -0.5, -1.0, -1.0]))


@pytest.mark.parametrize("max_len,buffer_len", [(10, 0), (10, 11)])
def test_overlong_penalty_rejects_bad_buffer(max_len, buffer_len):
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([1]), max_len, buffer_len)


def test_dynamic_sampling_keep_by_hand():
    # group 0 all right → drop; group 1 mixed → keep; group 2 all wrong → drop;
    # group 3 has one sample → keep
    metric = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    keep = dynamic_sampling_keep(metric, groups)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False, False, True, True, False, False, True]


def test_dynamic_sampling_keep_unsorted_labels_and_bool_metric():
    metric = torch.tensor([True, False, True, True, True])
    groups = torch.tensor([9, 4, 9, 4, 9])  # 9: all True → drop; 4: mixed → keep
    assert dynamic_sampling_keep(metric, groups).tolist() == [False, True, False, True, False]


def test_dynamic_sampling_keep_matches_reference():
    gen = torch.Generator().manual_seed(0)
    metric = torch.randint(0, 3, (40,), generator=gen).float() / 2
    groups = torch.randint(0, 12, (40,), generator=gen)
    expected = []
    for i in range(40):
        members = [metric[j].item() for j in range(40) if groups[j] == groups[i]]
        expected.append(len(members) == 1 or max(members) != min(members))
    assert dynamic_sampling_keep(metric, groups).tolist() == expected
