"""The parallel layout (MoE Parallel Folding), validated without any process group.

Attention and dense layers use TP x CP x DP x PP; MoE layers use ETP x EP x EDP x PP over
the same ranks. DP and EDP are derived from the world size. Field names are Megatron's.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

#: Megatron's rank order for the dense mapping (the expert mapping drops cp and uses ep).
RANK_ORDER = "tp-cp-ep-dp-pp"


class LayoutError(ValueError):
    """A parallel layout that cannot run; the message says why in one sentence."""


def sequence_multiple(cp_size: int, tp_sequence_parallel: int = 1) -> int:
    """What every sequence's length must be a multiple of: 2·CP chunks, each a multiple of
    TP under sequence parallelism (the local row is split over TP once more)."""
    return 2 * cp_size * tp_sequence_parallel if cp_size > 1 else tp_sequence_parallel


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The model numbers a layout must divide (filled from the model config)."""

    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    num_moe_experts: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    moe_shared_expert_intermediate_size: Optional[int] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How one model (actor, critic) is split over the ranks."""

    tensor_model_parallel_size: int = 1
    """TP: attention heads and MLP columns/rows split over this many ranks."""
    pipeline_model_parallel_size: int = 1
    """PP: layers split into this many consecutive stages (shared by dense and MoE)."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """VPP: model chunks per pipeline stage (interleaved schedule); None = off."""
    context_parallel_size: int = 1
    """CP: every sequence split over this many ranks (Megatron's load-balanced 2·CP chunks)."""
    expert_model_parallel_size: int = 1
    """EP: experts distributed over this many ranks."""
    expert_tensor_parallel_size: Optional[int] = None
    """ETP: each expert's weights split over this many ranks; None = same as TP."""
    sequence_parallel: bool = True
    """Split activations outside attention/MLP over TP ranks (used only when TP > 1)."""

    # ---- derived sizes
    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def vpp(self) -> int:
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    @property
    def ep(self) -> int:
        return self.expert_model_parallel_size

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    def dp(self, world_size: int) -> int:
        """Data-parallel size of the dense mapping: W / (TP * CP * PP)."""
        return world_size // (self.tp * self.cp * self.pp)

    def edp(self, world_size: int) -> int:
        """Expert-data-parallel size of the MoE mapping: W / (ETP * EP * PP)."""
        return world_size // (self.etp * self.ep * self.pp)

    def megatron_sizes(self) -> dict:
        """The six sizes under Megatron's own argument names (initialize_model_parallel and
        TransformerConfig take the same ones), ETP resolved."""
        return dict(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.virtual_pipeline_model_parallel_size,
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
        )

    @property
    def sequence_parallel_enabled(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    # ---- validation
    def validate(self, world_size: int, model: Optional[ModelShape] = None) -> "ParallelConfig":
        """Raise LayoutError naming the first problem; return self when the layout fits."""
        sizes = {
            "tensor_model_parallel_size": self.tensor_model_parallel_size,
            "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
            "context_parallel_size": self.context_parallel_size,
            "expert_model_parallel_size": self.expert_model_parallel_size,
            "expert_tensor_parallel_size": self.etp,
            "virtual_pipeline_model_parallel_size": self.vpp,
        }
        for name, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name}={value!r} must be a positive integer")
        if world_size < 1:
            raise LayoutError(f"world size {world_size} must be a positive integer")
        dense = self.tp * self.cp * self.pp
        if world_size % dense:
            raise LayoutError(
                f"world size {world_size} is not divisible by tensor_model_parallel_size x "
                f"context_parallel_size x pipeline_model_parallel_size = {self.tp}x{self.cp}x{self.pp}"
            )
        expert = self.etp * self.ep * self.pp
        if world_size % expert:
            raise LayoutError(
                f"world size {world_size} is not divisible by expert_tensor_parallel_size x "
                f"expert_model_parallel_size x pipeline_model_parallel_size = {self.etp}x{self.ep}x{self.pp}"
            )
        if self.virtual_pipeline_model_parallel_size is not None and self.pp < 2:
            raise LayoutError(
                "virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size >= 2, "
                f"got pipeline_model_parallel_size={self.pp}"
            )
        if model is not None:
            self._validate_model(model)
        return self

    def _validate_model(self, m: ModelShape) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise LayoutError(message)

        chunks = self.pp * self.vpp
        need(
            m.num_layers % chunks == 0,
            f"num_layers={m.num_layers} is not divisible by pipeline_model_parallel_size x "
            f"virtual_pipeline_model_parallel_size = {self.pp}x{self.vpp}",
        )
        need(
            m.num_attention_heads % self.tp == 0,
            f"tensor_model_parallel_size={self.tp} does not divide num_attention_heads={m.num_attention_heads}",
        )
        need(
            m.num_query_groups % self.tp == 0,
            f"tensor_model_parallel_size={self.tp} does not divide num_query_groups "
            f"(key/value heads)={m.num_query_groups}",
        )
        need(
            m.ffn_hidden_size % self.tp == 0,
            f"tensor_model_parallel_size={self.tp} does not divide ffn_hidden_size={m.ffn_hidden_size}",
        )
        if not m.num_moe_experts:
            need(
                self.ep == 1 and self.etp == self.tp,
                f"expert_model_parallel_size={self.ep} / expert_tensor_parallel_size={self.etp} "
                "need a MoE model; this model has no experts",
            )
            return
        need(
            m.num_moe_experts % self.ep == 0,
            f"expert_model_parallel_size={self.ep} does not divide num_moe_experts={m.num_moe_experts}",
        )
        moe_ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
        need(
            moe_ffn % self.etp == 0,
            f"expert_tensor_parallel_size={self.etp} does not divide moe_ffn_hidden_size={moe_ffn}",
        )
        shared = m.moe_shared_expert_intermediate_size
        need(
            not shared or shared % self.tp == 0,
            f"tensor_model_parallel_size={self.tp} does not divide the shared expert size {shared}",
        )
        need(
            not (self.tp > 1 and self.ep > 1 and not self.sequence_parallel),
            "MoE with tensor_model_parallel_size>1 and expert_model_parallel_size>1 needs sequence_parallel=true",
        )

    def describe(self, world_size: int) -> str:
        """One line: both mappings with their derived sizes."""
        vpp = f" VPP{self.vpp}" if self.vpp > 1 else ""
        return (
            f"dense TP{self.tp}·CP{self.cp}·DP{self.dp(world_size)}·PP{self.pp}{vpp} | "
            f"MoE ETP{self.etp}·EP{self.ep}·EDP{self.edp(world_size)}·PP{self.pp} "
            f"(world {world_size})"
        )
