"""models.lora on one rank (CPU): a new adapter (B = 0) leaves the logits exactly the base's;
with B set, the logits equal the base model with W + (alpha/r)·B·A merged into its weights
(the independent expectation, fp32 within rounding); only the adapters get gradients, and
Megatron's DDP and distributed optimizer hold state for them alone."""

import pytest
import torch

from megatron_rl import platform
from megatron_rl.models.lora import LoraAdapter, LoraSettings, add_adapters
from megatron_rl.parallel import ParallelConfig

MERGE_TOL = 1e-5  # fp32: the merged model multiplies (W + sBA) x, the adapter W x + s B (A x)


def build(arch):
    from megatron_rl.models.builder import BuildOptions, build_model

    torch.manual_seed(7)
    (model,) = build_model("actor", arch, ParallelConfig(), BuildOptions())
    return model


def logits(model, tokens):
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with platform.megatron_scope():
        return model(tokens, positions, attention_mask=None)


def merged(arch, adapted, scaling: float):
    """A fresh build of the base (the same seed: the same weights) with every adapter of
    ``adapted`` folded into its linear's weight."""
    model = build(arch)
    linears = dict(model.named_modules())
    with torch.no_grad():
        for name, module in adapted.named_modules():
            if isinstance(module, LoraAdapter):
                linears[name.removesuffix("_lora")].weight += scaling * module.b @ module.a
    return model


def set_b(adapters: dict, seed: int) -> None:
    """Every adapter's B to seeded non-zero values, so that each moves the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for adapter in adapters.values():
            adapter.b.copy_(torch.randn(adapter.b.shape, generator=g) * 0.05)


@pytest.fixture
def tokens():
    from megatron_rl_lab.testing.tiny import TINY_DENSE

    return torch.randint(0, TINY_DENSE.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))


def test_a_new_adapter_leaves_the_logits_exactly_the_bases(world_of_one, tokens):
    from megatron_rl_lab.testing.tiny import TINY_DENSE

    model = build(TINY_DENSE)
    want = logits(model, tokens).detach()
    adapters = add_adapters([model], LoraSettings(rank=4, alpha=8))
    assert len(adapters) == 4 * TINY_DENSE.num_layers
    assert torch.equal(logits(model, tokens).detach(), want)


def test_trained_adapters_equal_their_merge_into_the_weights(world_of_one, tokens):
    from megatron_rl_lab.testing.tiny import TINY_DENSE

    model = build(TINY_DENSE)
    settings = LoraSettings(rank=4, alpha=8)
    adapters = add_adapters([model], settings)
    set_b(adapters, seed=11)
    reference = merged(TINY_DENSE, model, settings.scaling)
    got, want = logits(model, tokens), logits(reference, tokens).detach()
    scale = want.abs().max().item()
    assert (got.detach() - want).abs().max().item() <= MERGE_TOL * scale
    assert (got.detach() - logits(build(TINY_DENSE), tokens).detach()).abs().max().item() > 1e-3 * scale
    got.float().pow(2).mean().backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained == {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("_lora." in n for n in trained)


def test_ddp_and_the_distributed_optimizer_hold_the_adapters_only(world_of_one):
    from megatron_rl.models.builder import wrap_for_training
    from megatron_rl_lab.testing.tiny import TINY_DENSE

    model = build(TINY_DENSE)
    adapters = add_adapters([model], LoraSettings(rank=4, alpha=8, targets=("qkv", "fc2")))
    adapter_elements = sum(p.numel() for a in adapters.values() for p in a.parameters())
    (ddp,), optimizer = wrap_for_training([model], dtype="fp32", lr=1e-3, clip_grad=1.0)
    buffered = sum(b.numel_unpadded for b in ddp.buffers)
    assert buffered == adapter_elements < sum(p.numel() for p in model.parameters()) / 10
    optimized = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    assert optimized == adapter_elements


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match=r"lora targets \['gate'\]: choose from qkv, proj, fc1, fc2, experts"):
        LoraSettings(targets=("qkv", "gate"))
    with pytest.raises(ValueError, match="lora needs rank >= 1"):
        LoraSettings(rank=0)


def test_the_sync_sees_the_merged_weights_and_the_base_comes_back_exactly(world_of_one):
    """The HF export (what the weight sync streams) inside ``merged_into_weights`` is the merged
    model's, adapter tensors left out; after it the base is bitwise as before, same storage."""
    from megatron_rl.bridge import iter_hf_tensors
    from megatron_rl.models.lora import merged_into_weights
    from megatron_rl_lab.testing.tiny import TINY_DENSE

    model = build(TINY_DENSE)
    settings = LoraSettings(rank=4, alpha=8)
    adapters = add_adapters([model], settings)
    set_b(adapters, seed=5)
    before = {n: (p.detach().clone(), p.data_ptr()) for n, p in model.named_parameters()}
    base_export = dict(iter_hf_tensors([build(TINY_DENSE)], TINY_DENSE))
    with merged_into_weights([model]):
        exported = dict(iter_hf_tensors([model], TINY_DENSE))
    want = dict(iter_hf_tensors([merged(TINY_DENSE, model, settings.scaling)], TINY_DENSE))
    assert exported.keys() == want.keys() == base_export.keys()  # no adapter tensor among them
    assert all(torch.equal(exported[k], want[k]) for k in want)
    changed = [k for k in want if not torch.equal(want[k], base_export[k])]
    # q, k, v (QKV), o (proj), gate and up (FC1), down (FC2): every adapted linear moved, nothing else
    assert len(changed) == 7 * TINY_DENSE.num_layers, changed
    for name, param in model.named_parameters():
        value, pointer = before[name]
        assert torch.equal(param.detach(), value) and param.data_ptr() == pointer, name


def test_experts_get_adapters_of_their_own_which_start_at_the_base_and_merge(world_of_one, tokens):
    from megatron_rl_lab.testing.tiny import TINY_QWEN3_MOE

    model = build(TINY_QWEN3_MOE)
    want = logits(model, tokens).detach()
    settings = LoraSettings(rank=4, alpha=8, targets=("qkv", "experts"))
    adapters = add_adapters([model], settings)
    per_layer = 1 + 2 * TINY_QWEN3_MOE.num_moe_experts
    assert len(adapters) == per_layer * TINY_QWEN3_MOE.num_layers
    assert torch.equal(logits(model, tokens).detach(), want)
    set_b(adapters, seed=2)
    got, reference = logits(model, tokens).detach(), logits(merged(TINY_QWEN3_MOE, model, settings.scaling), tokens)
    assert (got - reference.detach()).abs().max().item() <= MERGE_TOL * reference.abs().max().item()


def test_grouped_experts_are_refused_as_lora_targets(world_of_one):
    from megatron_rl.models.builder import BuildOptions, build_model
    from megatron_rl_lab.testing.tiny import TINY_QWEN3_MOE

    (model,) = build_model("actor", TINY_QWEN3_MOE, ParallelConfig(), BuildOptions(experts="grouped"))
    with pytest.raises(ValueError, match="LoRA on experts needs Megatron's SequentialMLP experts"):
        add_adapters([model], LoraSettings(targets=("experts",)))


def test_a_critics_new_value_head_trains_in_full_beside_its_adapters(world_of_one):
    from megatron_rl.bridge.load import VALUE_HEAD_PREFIX
    from megatron_rl.models.builder import BuildOptions, build_model
    from megatron_rl_lab.testing.tiny import TINY_DENSE

    (critic,) = build_model("critic", TINY_DENSE, ParallelConfig(), BuildOptions())
    add_adapters([critic], LoraSettings(rank=4, alpha=8), keep_training=(VALUE_HEAD_PREFIX,))
    trained = {n for n, p in critic.named_parameters() if p.requires_grad}
    head = {n for n, _ in critic.named_parameters() if n.startswith(VALUE_HEAD_PREFIX)}
    assert head and head <= trained
    assert trained - head and all("_lora." in n for n in trained - head)
