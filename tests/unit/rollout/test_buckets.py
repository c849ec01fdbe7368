"""Buckets are size-bounded and never split a decoder layer (vLLM reload needs whole layers)."""

import torch

from megatron_rl.rollout.sync import buckets, layer_key


def _stream():
    names = ["model.embed_tokens.weight"]
    for layer in range(3):
        names += [f"model.layers.{layer}.self_attn.q_proj.weight", f"model.layers.{layer}.mlp.down_proj.weight"]
    names += ["model.norm.weight", "lm_head.weight"]
    return [(n, torch.zeros(256)) for n in names]  # 1 KiB each


def test_layer_key():
    assert layer_key("model.layers.12.mlp.experts.3.up_proj.weight") == "model.layers.12"
    assert layer_key("lm_head.weight") == "lm_head.weight"


def test_every_tensor_once_in_order_and_layers_whole():
    stream = _stream()
    out = list(buckets(iter(stream), bucket_bytes=1500))
    assert [n for b in out for n, _ in b] == [n for n, _ in stream]
    for b in out:
        layers = {layer_key(n) for n, _ in b}
        for other in out:
            if other is not b:
                assert not layers & {layer_key(n) for n, _ in other}
    # 1500 B: a layer (2 KiB) is a bucket of its own; embeddings, norm and head are 1 KiB
    # keys that do not fit together in 1.5 KiB either.
    assert [len(b) for b in out] == [1, 2, 2, 2, 1, 1]
    # 4 KiB: whole layers up to the size, never more.
    assert [len(b) for b in buckets(iter(stream), bucket_bytes=4096)] == [3, 4, 2]


def test_one_bucket_when_large():
    assert len(list(buckets(iter(_stream()), bucket_bytes=1 << 30))) == 1
