"""PlannedGather: the same selected full tensors as gather_full, call after call, following
the parameters' new values and a parameter whose storage moved (at world 1; the TP2 case is
the adapter sync's, tests/distributed/test_adapter_sync.py)."""

import torch


def test_it_gathers_what_gather_full_does_and_follows_moved_storage(world_of_one):
    from megatron_rl.models.builder import BuildOptions, build_model
    from megatron_rl.parallel import ParallelConfig
    from megatron_rl.parallel.full_tensors import PlannedGather, gather_full
    from megatron_rl_lab.testing.tiny import TINY_DENSE

    (model,) = build_model("actor", TINY_DENSE, ParallelConfig(), BuildOptions())
    only = lambda name: name.endswith("linear_qkv.weight")  # noqa: E731
    gather = PlannedGather([model], only)
    first = {k: v.clone() for k, v in gather.gather().items()}
    want = gather_full([model], only=only)
    assert sorted(first) == sorted(want) and len(want) == TINY_DENSE.num_layers
    assert all(torch.equal(first[k], want[k]) for k in want)
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    with torch.no_grad():
        qkv.add_(1.0)  # a new value in place
    assert torch.equal(gather.gather()["decoder.layers.0.self_attention.linear_qkv.weight"], qkv.detach())
    qkv.data = qkv.detach() * 2.0  # new storage: the kept views would read the old one
    got = gather.gather()["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(got, qkv.detach()) and not torch.equal(
        got, first["decoder.layers.0.self_attention.linear_qkv.weight"] + 1
    )
