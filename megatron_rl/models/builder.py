"""Build Megatron-Core GPT actors and critics from a :class:`ModelArch` and a layout.

The actor is Megatron's ``GPTModel`` (LM head). The critic is the same backbone with the
LM head swapped for a scalar value head (:mod:`.value_head`). Under virtual pipeline
parallelism a rank holds several model chunks, so builders return a list of modules.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import torch
import torch.nn.functional as F

from megatron_rl import platform
from megatron_rl.models.hf_config import MOE_FIELDS, ModelArch
from megatron_rl.models.layer_spec import block_spec
from megatron_rl.parallel.config import ParallelConfig
from megatron_rl.parallel.state import require_current
from megatron_rl.utils import dtypes

Role = Literal["actor", "critic"]


DISPATCHERS = ("alltoall", "allgather", "local")
"""MoE token dispatchers: Megatron's two, and models.local_dispatch's."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildOptions:
    """Numerics and MoE knobs that are not part of the HF architecture."""

    dtype: str = "fp32"
    """Parameter dtype: fp32 | bf16 | fp16."""
    moe_token_dispatcher_type: str = "alltoall"
    """MoE dispatcher: Megatron's alltoall | allgather, or local (every expert on this rank,
    no host sync: models.local_dispatch)."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing loss weight (0 = off, the usual choice for RL fine-tuning)."""
    vocab_size_divisible_by: int = 1
    """Pad the vocabulary to a multiple of this times TP (padded logits are masked out)."""
    init_method_std: float = 0.02
    """Std of the random init (real runs load weights through the bridge)."""
    recompute_activations: bool = False
    """Full activation recomputation of each layer (memory for compute)."""
    attention: str = "auto"
    """auto | sdpa | unfused: which attention the layers use (models.layer_spec.ATTENTIONS)."""
    experts: str = "auto"
    """auto | sequential | grouped: how MoE experts are computed (models.layer_spec.EXPERTS)."""
    fusion: str = "none"
    """none | compiled: the layers' elementwise work (norms, RoPE, gated SiLU) as shipped or
    compiled by torch.compile (models.fused_elementwise)."""

    def __post_init__(self):
        from megatron_rl.models.fused_elementwise import FUSIONS
        from megatron_rl.models.layer_spec import ATTENTIONS, EXPERTS

        if self.attention not in ATTENTIONS:
            raise ValueError(f"BuildOptions.attention {self.attention!r} is not one of {', '.join(ATTENTIONS)}")
        if self.experts not in EXPERTS:
            raise ValueError(f"BuildOptions.experts {self.experts!r} is not one of {', '.join(EXPERTS)}")
        if self.moe_token_dispatcher_type not in DISPATCHERS:
            raise ValueError(
                f"BuildOptions.moe_token_dispatcher_type {self.moe_token_dispatcher_type!r} is not one of "
                f"{', '.join(DISPATCHERS)}"
            )
        if self.fusion not in FUSIONS:
            raise ValueError(f"BuildOptions.fusion {self.fusion!r} is not one of {', '.join(FUSIONS)}")


def megatron_dispatcher(name: str) -> str:
    """The dispatcher Megatron's config names: for local, its alltoall, which the layer replaces
    (models.layer_spec)."""
    return "alltoall" if name == "local" else name


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 1) -> int:
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def transformer_config(arch: ModelArch, parallel: ParallelConfig, options: BuildOptions):
    """The Megatron ``TransformerConfig`` for this architecture and layout."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl.models.fused_elementwise import transformer_config_fields

    dtype = dtypes.to_torch(options.dtype)
    moe = {}
    if arch.is_moe:
        moe = dict(
            **{name: getattr(arch, name) for name in MOE_FIELDS},
            moe_token_dispatcher_type=megatron_dispatcher(options.moe_token_dispatcher_type),
            moe_router_load_balancing_type="aux_loss" if options.moe_aux_loss_coeff else "none",
            moe_aux_loss_coeff=options.moe_aux_loss_coeff,
            moe_grouped_gemm=False,
            moe_router_dtype="fp32",
        )
    recompute = (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if options.recompute_activations
        else {}
    )
    with platform.megatron_scope():
        return TransformerConfig(
            num_layers=arch.num_layers,
            hidden_size=arch.hidden_size,
            num_attention_heads=arch.num_attention_heads,
            num_query_groups=arch.num_query_groups,
            kv_channels=arch.head_dim,
            ffn_hidden_size=arch.ffn_hidden_size,
            normalization="RMSNorm",
            layernorm_epsilon=arch.norm_epsilon,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=arch.qkv_bias,
            qk_layernorm=arch.qk_layernorm,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            init_method_std=options.init_method_std,
            **parallel.megatron_sizes(),
            sequence_parallel=parallel.sequence_parallel_enabled,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            **moe,
            **recompute,
            **{**platform.transformer_config_overrides(), **transformer_config_fields(options.fusion)},
        )


def build_model(
    role: Role,
    arch: ModelArch,
    parallel: ParallelConfig,
    options: Optional[BuildOptions] = None,
    pg_collection=None,
) -> list[torch.nn.Module]:
    """The model chunks this rank holds (one per virtual pipeline stage), for ``parallel``,
    which must be the layout of Megatron's current groups (inside its context's ``active()``
    when a process holds several): Megatron builds from its current groups whatever layout
    the config names, so a mismatch is refused here rather than trained wrongly."""
    from megatron.core import parallel_state as ps

    require_current(parallel, f"build_model({role!r})")
    options = options or BuildOptions()
    config = transformer_config(arch, parallel, options)
    pp_rank, pp_size = ps.get_pipeline_model_parallel_rank(), parallel.pp
    chunks = []
    with platform.megatron_scope():
        for vp_stage in range(parallel.vpp):
            vp = vp_stage if parallel.virtual_pipeline_model_parallel_size else None
            first = pp_rank == 0 and vp_stage == 0
            last = pp_rank == pp_size - 1 and vp_stage == parallel.vpp - 1
            chunks.append(_build_chunk(role, arch, parallel, options, config, first, last, vp, pg_collection))
    if platform.current().is_cuda:
        # Megatron creates its own layers' weights on the GPU, but not the torch modules of
        # the local spec (SequenceParallelRMSNorm) or the critic's value head; Megatron's
        # training loop moves every chunk likewise before wrapping it.
        for chunk in chunks:
            chunk.cuda(platform.current().device)
    return chunks


def _build_chunk(role, arch, parallel, options, config, pre_process, post_process, vp_stage, pg_collection):
    from megatron.core.models.gpt import GPTModel

    from megatron_rl.models.value_head import CriticGPTModel

    cls = GPTModel if role == "actor" else CriticGPTModel
    kwargs = {"pg_collection": pg_collection} if pg_collection is not None else {}
    return cls(
        config=config,
        transformer_layer_spec=block_spec(config, arch, vp_stage, options),
        vocab_size=padded_vocab_size(arch.vocab_size, parallel.tp, options.vocab_size_divisible_by),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings and role == "actor",
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
        vp_stage=vp_stage,
        **kwargs,
    )


def wrap_for_training(
    chunks: list[torch.nn.Module], *, dtype: str, lr: float, clip_grad: float, weight_decay: float = 0.0
):
    """``chunks`` (weights already in place) in Megatron DDP with the distributed optimizer
    (Adam; fp32 main params under bf16), as every training path uses them: the optimizer
    copies its main params from the weights here, so load them before, not after."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = chunks[0].config
    with platform.megatron_scope():
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=False)
        chunks = [DistributedDataParallel(config, ddp, c) for c in chunks]
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=lr,
                bf16=dtype == "bf16",
                use_distributed_optimizer=True,
                clip_grad=clip_grad,
                weight_decay=weight_decay,
            ),
            chunks,
        )
    config.finalize_model_grads_func = finalize_model_grads
    return chunks, optimizer
