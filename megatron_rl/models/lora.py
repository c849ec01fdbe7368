"""LoRA adapters on Megatron-Core's tensor-parallel linears: the base frozen, two small
matrices trained beside each target, ``y = W x + (alpha / r) · B A x``.

Why beside and not inside: Megatron's linears describe their own sharding
(``sharded_state_dict``: the weight split on one axis, everything else replicated), so an
adapter registered inside one would be saved and gathered as if replicated. Each adapter is
a module of its own next to its linear (``linear_qkv`` gets ``linear_qkv_lora``), with its own
sharding, and a forward hook on the linear adds its output. The base's parameter names,
checkpoints and HF mapping are unchanged; ``requires_grad`` is off on every base parameter,
so Megatron's DDP gives them no gradient buffer and the distributed optimizer no state.

How A and B split under tensor parallelism (TP ranks ``t``; sequence parallelism ``SP``):

* column-parallel linears (QKV, FC1: the output split): ``A`` [r, in] whole on every rank,
  ``B`` [out/t, r] split like the weight. ``A x`` is the same on every rank; its gradient
  sums over the output shards, so the hook passes it through Megatron's copy-to-TP region
  (identity forward, all-reduce backward). Under SP the input is a sequence shard: ``A x``
  of the shard is gathered along the sequence (r channels, not the hidden size) and ``A``'s
  gradient, which then covers this rank's tokens only, is summed over TP by Megatron's
  ``finalize_model_grads`` (the ``sequence_parallel`` mark the norms carry).
* row-parallel linears (attention output, FC2: the input split): ``A`` [r, in/t] split like
  the weight, ``B`` [out, r] whole. ``A x`` is a partial sum, all-reduced over TP (r
  channels); under SP, ``B A x`` is then cut to this rank's sequence shard (split forward,
  all-gather backward), so ``B``'s gradient is whole on every rank either way.
* experts under EP or ETP, whose dispatcher exchanges the tokens and sums the ETP ranks'
  partial outputs itself: the adapter stays partial as the expert's linear does, and only the
  whole factor's gradient is all-reduced over the expert-TP group (:meth:`LoraAdapter._expert_forward`).

A starts as ``torch.nn.Linear``'s default (Kaiming-uniform, bound 1/sqrt(in), as PEFT does),
drawn from a generator seeded by the adapter's name, so every layout draws the same full
matrix and keeps its slice; B starts at zero, so a new adapter leaves the logits exactly as
the base's. Dropout on the adapter's input uses the default generator on replicated inputs
(the same on every TP rank) and Megatron's model-parallel fork on split ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import zlib
from typing import Iterator, Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megatron_rl.models.adapter_names import ADAPTER_SUFFIX, TARGET_LINEARS, merged_weight
from megatron_rl.models.grouped_experts import GroupedGemmExperts

TARGETS = {name: tuple(path.split(".")) for name, path in TARGET_LINEARS.items()}
"""Target name -> (the layer's submodule, the linear in it) (adapter_names.TARGET_LINEARS).
Experts are Megatron's SequentialMLP experts, whose linears run one per expert; the grouped
experts bypass them."""


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = tuple(TARGETS)
    seed: int = 0
    """Seeds each adapter's A (with its name): the same A in every layout."""

    def __post_init__(self):
        if self.rank < 1 or self.alpha <= 0 or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora needs rank >= 1, alpha > 0, 0 <= dropout < 1; got {self}")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown or not self.targets:
            raise ValueError(f"lora targets {unknown or '[]'}: choose from {', '.join(TARGETS)}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class LoraAdapter(MegatronModule):
    """The A and B of one linear (``column``: output split, ``row``: input split)."""

    def __init__(self, linear, settings: LoraSettings, name: str, gated: bool = False):
        super().__init__(config=linear.config)
        if not isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
            raise ValueError(f"{name}: LoRA adapts Megatron's local linears, not {type(linear).__name__}")
        self.column = isinstance(linear, ColumnParallelLinear)
        self.gated = gated
        """A gated FC1: each rank's rows are [its gate shard; its up shard], saved as Megatron
        saves the weight (the whole gate, then the whole up)."""
        # An expert's linears under EP or ETP leave the token exchange and the output's reduction
        # to the dispatcher ("explicit expert communication"); so does its adapter.
        self.explicit = getattr(linear, "explicit_expert_comm", False)
        self.tp_group = linear.tp_group
        self.sequence_parallel = linear.sequence_parallel and not self.explicit
        self.scaling = settings.scaling
        tp, rank = self.tp_group.size(), self.tp_group.rank()
        weight = linear.weight
        full_a = _kaiming_uniform(settings.rank, linear.input_size, settings.seed, name)
        if self.column:
            a, b_shape = full_a, (linear.output_size // tp, settings.rank)
        else:
            width = linear.input_size // tp
            a, b_shape = full_a[:, rank * width : (rank + 1) * width], (linear.output_size, settings.rank)
        self.a = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
        self.b = torch.nn.Parameter(torch.zeros(b_shape, device=weight.device, dtype=weight.dtype))
        # Under SP a column adapter's A sees this rank's tokens only: finalize_model_grads sums it over TP.
        self.a.sequence_parallel = self.column and self.sequence_parallel
        self.b.sequence_parallel = False
        for param in (self.a, self.b):  # experts' gradients reduce over expert-data-parallel ranks only
            if hasattr(weight, "allreduce"):
                param.allreduce = weight.allreduce
        self.dropout = torch.nn.Dropout(settings.dropout) if settings.dropout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's ``scaling · B A x`` in the layout of the linear's output."""
        mappings = tensor_parallel.mappings
        x = self._dropped(x)
        if self.explicit:
            return self._expert_forward(x)
        h = torch.matmul(x, self.a.t())
        if self.column:
            h = (
                mappings.gather_from_sequence_parallel_region(h, group=self.tp_group)
                if self.sequence_parallel
                else mappings.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
            )
            return self.scaling * torch.matmul(h, self.b.t())
        h = mappings.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        y = self.scaling * torch.matmul(h, self.b.t())
        return mappings.scatter_to_sequence_parallel_region(y, group=self.tp_group) if self.sequence_parallel else y

    def _expert_forward(self, x: torch.Tensor) -> torch.Tensor:
        """An expert's adapter under EP or ETP. The dispatcher gives every ETP rank the same
        tokens and sums their partial outputs and input gradients, so the adapter's must be
        partial too: no exchange of activations. What each rank then lacks is the rest of the
        whole factor's gradient (A of a column linear, B of a row one): that factor passes
        through Megatron's copy-to-TP region (identity forward, all-reduce of its gradient)."""
        copy = tensor_parallel.mappings.copy_to_tensor_model_parallel_region
        a = copy(self.a, group=self.tp_group) if self.column else self.a
        b = self.b if self.column else copy(self.b, group=self.tp_group)
        return self.scaling * torch.matmul(torch.matmul(x, a.t()), b.t())

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout is None or not self.training:
            return x
        if self.column:  # the input is the same on every TP rank, so is the default generator
            return self.dropout(x)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return self.dropout(x)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: Optional[dict] = None):
        """B split on axis 0 (column) or A on axis 1 (row), as the linear's weight is."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        axis = {"b": 0} if self.column else {"a": 1}
        sharded = make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            axis,
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )
        if self.gated:
            singleton = (metadata or {}).get("singleton_local_shards", False)
            sharded[f"{prefix}b"] = apply_swiglu_sharded_factory(sharded[f"{prefix}b"], sharded_offsets, singleton)
        return sharded


def _kaiming_uniform(rows: int, fan_in: int, seed: int, name: str) -> torch.Tensor:
    """torch.nn.Linear's default init of a [rows, fan_in] weight, from (seed, name) alone."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(rows, fan_in, generator=generator) * 2 - 1) * bound


def _add_output(adapter: LoraAdapter):
    def hook(linear, args, output):
        out, bias = output
        return out + adapter(args[0]).to(out.dtype), bias

    return hook


def _target_linears(layer, target: str) -> list[tuple[torch.nn.Module, str, str]]:
    """(owner module, linear attribute, adapter name) of ``target`` in one decoder layer: none
    where the layer has no such linear (a MoE layer has no dense fc1, a dense one no experts)."""
    owner_name, linear_name = TARGETS[target]
    owner = getattr(layer, owner_name, None)
    moe = hasattr(owner, "router")  # a MoE layer's mlp: its experts are the "experts" target
    if target != "experts":
        if moe or not isinstance(getattr(owner, linear_name, None), torch.nn.Module):
            return []
        return [(owner, linear_name, f"layer{layer.layer_number}.{owner_name}.{linear_name}")]
    if not moe:
        return []
    experts = owner.experts
    if isinstance(experts, GroupedGemmExperts) or not hasattr(experts, "local_experts"):
        raise ValueError(
            f"LoRA on experts needs Megatron's SequentialMLP experts (BuildOptions experts=sequential), "
            f"not {type(experts).__name__}, whose kernels bypass the experts' linears"
        )
    found = []
    for local, expert in enumerate(experts.local_experts):
        number = owner.local_expert_indices[local]
        for name in ("linear_fc1", "linear_fc2"):
            found.append((expert, name, f"layer{layer.layer_number}.expert{number}.{name}"))
    return found


def add_adapters(
    chunks: list[torch.nn.Module], settings: LoraSettings, keep_training: tuple[str, ...] = ()
) -> dict[str, LoraAdapter]:
    """Freeze every parameter of ``chunks`` (unwrapped GPT models, before DDP) but those whose
    names start with one of ``keep_training`` (a critic's new value head: ``output_layer.``),
    and add an adapter beside each target linear; {the linear's name: its adapter}."""
    adapters = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            param.requires_grad = name.startswith(keep_training)  # (): every parameter frozen
        for layer in chunk.decoder.layers:
            for target in settings.targets:
                for owner, linear_name, name in _target_linears(layer, target):
                    linear = getattr(owner, linear_name)
                    gated = linear_name == "linear_fc1" and linear.config.gated_linear_unit
                    adapter = LoraAdapter(linear, settings, name, gated=gated)
                    owner.add_module(f"{linear_name}{ADAPTER_SUFFIX}", adapter)
                    linear.register_forward_hook(_add_output(adapter))
                    adapters[name] = adapter
    if not adapters:
        raise ValueError(f"lora targets {list(settings.targets)} match no linear of this model")
    return adapters


def adapted_linears(chunks: list[torch.nn.Module]) -> list[tuple[torch.nn.Module, LoraAdapter]]:
    """(linear, its adapter) for every adapter in ``chunks`` (wrapped or not), found beside
    its linear in the module tree."""
    pairs = []
    for chunk in chunks:
        for owner in chunk.modules():
            for name, child in owner.named_children():
                if isinstance(child, LoraAdapter):
                    pairs.append((getattr(owner, name.removesuffix(ADAPTER_SUFFIX)), child))
    return pairs


@contextlib.contextmanager
def merged_into_weights(chunks: list[torch.nn.Module]) -> Iterator[None]:
    """Inside: every adapted linear's weight is ``W + scaling · B A`` (in its own shard: B and
    A are split as the weight is, so no communication), for a reader of the base weights
    (the weight sync into vLLM, an HF export). After: the exact base again, restored from a
    copy (adding and subtracting the update would round the frozen base a little each time).
    The weights keep their storage, so readers that keep views of them stay valid."""
    pairs = adapted_linears(chunks)
    saved = []
    with torch.no_grad():
        for linear, adapter in pairs:
            weight = linear.weight
            saved.append((weight, weight.detach().clone()))
            weight.copy_(merged_weight(weight, adapter.a, adapter.b, adapter.scaling))
    try:
        yield
    finally:
        with torch.no_grad():
            for weight, original in saved:
                weight.copy_(original)
