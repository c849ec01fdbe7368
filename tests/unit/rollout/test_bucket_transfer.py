"""A weight bucket travels to the rollout ranks as one byte tensor (rollout/buckets.py):
cut back into the same names, shapes, dtypes and bits."""

import torch

from megatron_rl.rollout.buckets import bucket_bytes, pack_bucket, unpack_bucket


def test_a_bucket_of_mixed_dtypes_comes_back_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    bucket = [
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(6, 4, generator=gen)),
        ("model.layers.0.mlp.experts.w2_weight", torch.randn(2, 3, 5, generator=gen).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(7, generator=gen).to(torch.float16)),
        ("lm_head.weight", torch.randn(8, 4, generator=gen)[:, :3]),
    ]  # a non-contiguous view
    specs, flat = pack_bucket(bucket)
    # each tensor starts on an 8-byte boundary: 96, 60 -> 64, 14 -> 16, 96 bytes
    assert flat.dtype == torch.uint8 and flat.numel() == bucket_bytes(specs) == 96 + 64 + 16 + 96
    back = unpack_bucket(specs, flat.clone())
    assert [n for n, _ in back] == [n for n, _ in bucket]
    for (_, sent), (_, got) in zip(bucket, back):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), sent.contiguous().reshape(-1).view(torch.uint8))


def test_an_empty_bucket_is_an_empty_message():
    specs, flat = pack_bucket([])
    assert specs == [] and flat.numel() == 0 and unpack_bucket(specs, flat) == []
