"""The parity guard's weight half: read the synced weights back from a vLLM worker.

A logprob comparison cannot tell a wrong weight from bf16 rounding noise when the wrong
weight moves the logprobs little (one expert of many, a layer norm off by a permutation).
The weights themselves can be compared exactly: the sync exports each tensor in the
engine's dtype and vLLM only copies, shards and repacks it, so every element vLLM serves
must equal, bitwise, what the model's own loader makes of the exported tensor.

For one bucket (already loaded), on each worker:

1. every parameter of the bucket's modules is swapped for a NaN-filled scratch of its
   checkpoint-format shape (same class and loader), and the model's ``load_weights`` is run
   on the bucket again: the scratch now holds exactly what vLLM should serve (TP shard,
   fused q/k/v and gate/up, expert mapping), NaN where this bucket brings nothing;
2. the live parameters come back and each is compared with its scratch:

   - plain weights (norms, biases, embeddings, plain CPU linear weights) element by element;
   - packed CPU GEMM weights (oneDNN handles keep no readable weight) through the layer's
     own GEMM: multiplying a slice of the identity reads out up to ``max_columns`` columns
     of the weight exactly (each output is one weight times 1, plus zeros);
   - packed CPU MoE experts by packing the expected weights with vLLM's own packing op and
     comparing the packed forms.

Only modules kinds the in-place loader knows are read (:mod:`.inplace_load`); any other is
reported as unsupported, never silently passed. Written for vLLM's CPU backend (0.32.0).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Sequence

import torch

from megatron_rl.bridge.layer_names import hf_layer_prefix
from megatron_rl.platform.vllm_compat import tied_params_memo
from megatron_rl.platform.vllm_internals import dressed_like, prepack_moe_weight
from megatron_rl.rollout.inplace_load import InplaceLoader, layer_groups, worker_loader


@dataclasses.dataclass(frozen=True)
class WeightMismatch:
    """A vLLM parameter whose served values differ from the exported ones."""

    name: str
    differing: int
    compared: int


@dataclasses.dataclass(frozen=True)
class WeightCheckResult:
    compared_elements: int = 0
    mismatches: tuple[WeightMismatch, ...] = ()
    unsupported: tuple[str, ...] = ()

    def merged(self, other: "WeightCheckResult") -> "WeightCheckResult":
        return WeightCheckResult(
            self.compared_elements + other.compared_elements,
            self.mismatches + other.mismatches,
            self.unsupported + other.unsupported,
        )

    @classmethod
    def merge_all(cls, results: Iterable["WeightCheckResult"]) -> "WeightCheckResult":
        """Several workers' or ranks' results as one."""
        merged = cls()
        for result in results:
            merged = merged.merged(result)
        return merged

    def describe(self, limit: int = 3) -> str:
        """``model.layers.1.mlp.experts.w2_weight (2047 of 8192 elements differ), ...``"""
        shown = [f"{m.name} ({m.differing} of {m.compared} elements differ)" for m in self.mismatches[:limit]]
        more = len(self.mismatches) - limit
        return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


class WeightChecker:
    """Reads back one bucket at a time from the model an :class:`InplaceLoader` indexed."""

    def __init__(self, loader: InplaceLoader, max_columns: int = 256):
        self.loader, self.model, self.max_columns = loader, loader.model, max_columns
        self.packed = {s.name: s for staged in loader.by_layer.values() for s in staged}
        self._tied: dict[int, dict] = {}

    @torch.no_grad()
    def check(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> WeightCheckResult:
        result = WeightCheckResult()
        with tied_params_memo(self._tied):
            for prefix, group in layer_groups(named_tensors):
                result = result.merged(self._check_group(prefix, group))
        return result

    def _check_group(self, prefix: Optional[str], group: list) -> WeightCheckResult:
        owners = self._owners(prefix)
        scratch = {
            id(live): _scratch_like(live, self._meta(name, pname), module)
            for name, (module, pname, live) in owners.items()
        }
        self._swap(owners, lambda live: scratch[id(live)])
        try:
            self.model.load_weights(group)
        finally:
            self._swap(owners, lambda live: live)
        result, seen = WeightCheckResult(), set()
        for name, (module, pname, live) in owners.items():
            if id(live) in seen:
                continue  # a tied parameter: compared once
            seen.add(id(live))
            result = result.merged(self._compare(name, module, pname, live, scratch[id(live)]))
        return result

    def _owners(self, prefix: Optional[str]) -> dict[str, tuple[torch.nn.Module, str, torch.nn.Parameter]]:
        """Every parameter of the decoder layer ``prefix`` (None: those outside the layers)."""
        owners = {}
        for mname, module in self.model.named_modules():
            for pname, param in module.named_parameters(recurse=False):
                name = f"{mname}.{pname}" if mname else pname
                if hf_layer_prefix(name) == prefix:
                    owners[name] = (module, pname, param)
        return owners

    def _meta(self, name: str, pname: str) -> Optional[torch.Tensor]:
        staged = self.packed.get(name.rsplit(".", 1)[0])
        return staged.meta.get(pname) if staged is not None else None

    def _swap(self, owners: dict, pick) -> None:
        for module, pname, live in owners.values():
            module.register_parameter(pname, pick(live))

    def _compare(self, name, module, pname, live, expected) -> WeightCheckResult:
        staged = self.packed.get(name.rsplit(".", 1)[0])
        if staged is None:
            if live.numel() == 0:
                return WeightCheckResult(unsupported=(f"{name}: no readable weight",))
            if name in self.loader.lm_heads:  # a plain weight and a GEMM handle packed from it
                return _plain(name, live, expected).merged(self._gemm(name + "[gemm]", module, expected))
            return _plain(name, live, expected)
        if _unloaded(expected):
            return WeightCheckResult()
        if staged.kind == "linear":
            return self._gemm(name, module, expected)
        return _packed_moe(name, live, expected, staged.isa)

    def _gemm(self, name: str, module: torch.nn.Module, expected: torch.Tensor) -> WeightCheckResult:
        """Columns of ``expected`` ([out, in]) against what the layer's GEMM computes from
        rows of the identity (bias left out)."""
        if _unloaded(expected):
            return WeightCheckResult()
        columns = torch.linspace(0, expected.shape[1] - 1, min(self.max_columns, expected.shape[1])).long().unique()
        probe = torch.eye(expected.shape[1], dtype=expected.dtype)[columns]
        served = module.quant_method.apply(module, probe).t()
        return _plain(name, served, expected[:, columns])


def _plain(name: str, served: torch.Tensor, expected: torch.Tensor) -> WeightCheckResult:
    """Element-wise comparison where the bucket brought a value (not NaN in ``expected``)."""
    if served.shape != expected.shape:
        return WeightCheckResult(
            unsupported=(f"{name}: served shape {tuple(served.shape)} != {tuple(expected.shape)}",)
        )
    loaded = ~torch.isnan(expected)
    compared = int(loaded.sum())
    differing = int((served.to(expected.dtype)[loaded] != expected[loaded]).sum())
    return WeightCheckResult(compared, (WeightMismatch(name, differing, compared),) if differing else ())


def _packed_moe(name: str, live: torch.Tensor, expected: torch.Tensor, isa: str) -> WeightCheckResult:
    packed = torch.empty_like(live)
    prepack_moe_weight(expected.contiguous(), packed, isa)
    differing = int((packed != live).sum())
    return WeightCheckResult(live.numel(), (WeightMismatch(name, differing, live.numel()),) if differing else ())


def _unloaded(expected: torch.Tensor) -> bool:
    """A packed module is compared only when the bucket brought all of its weight."""
    return bool(torch.isnan(expected).any())


def _scratch_like(
    live: torch.nn.Parameter, meta: Optional[torch.Tensor], module: torch.nn.Module
) -> torch.nn.Parameter:
    """A NaN-filled parameter of ``meta``'s (the checkpoint format's) or ``live``'s shape,
    filled by the model's loader like the live one."""
    template = meta if meta is not None else live
    data = torch.full(tuple(template.shape), float("nan"), dtype=template.dtype)
    return dressed_like(data, template, module, restore_refs=meta is not None)


# -- worker-side entry point (collective_rpc on every vLLM worker) ---------------------

_ATTR = "_megatron_rl_weight_checker"


def check_on_worker(worker, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> WeightCheckResult:
    loader = worker_loader(worker)
    if loader.unsupported():
        return WeightCheckResult(unsupported=tuple(loader.unsupported()))
    checker = getattr(worker.model_runner, _ATTR, None)
    if checker is None or checker.loader is not loader:
        checker = WeightChecker(loader)
        setattr(worker.model_runner, _ATTR, checker)
    return checker.check(named_tensors)
