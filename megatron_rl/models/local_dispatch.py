"""A MoE token dispatcher for layers whose experts all live on this rank, without a host sync.

Megatron's alltoall dispatcher at expert-parallel and expert-tensor-parallel size 1 has no
one to talk to, yet it still (0.16.1) copies the per-expert token counts to the host and
waits for them, selects each expert's tokens with ``masked_select`` (whose output size the
host must read back), and splits and concatenates the permuted tokens by those host counts
in both directions, an identity copy of every token when there is one source rank. On one
H200 the MoE preset's GPU sat idle 0.55 s of a 1.68 s step (docs/benchmarks.md).

Without token drops every token goes to exactly ``topk`` experts, so the permuted size is
known: ``nonzero_static`` of the expert-major routing map lists the same (expert, token)
pairs in the same order as ``masked_select`` does, with no read-back. The counts stay on the
device for the grouped experts (models.grouped_experts), which need only their prefix sum
there (SequentialMLP reads them on the host, which syncs there instead). Results equal the
alltoall dispatcher's bit for bit (tests/unit/models/test_local_dispatch.py).
``BuildOptions(moe_token_dispatcher_type="local")`` selects it (models.layer_spec); Megatron's
config then names its alltoall dispatcher, which the layer replaces.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection, unpermute
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher


def local_dispatch_problem(config) -> str:
    """Why a MoE layer of ``config`` cannot use :class:`LocalTokenDispatcher` ('' if it can)."""
    problems = {
        f"expert_model_parallel_size {config.expert_model_parallel_size}": config.expert_model_parallel_size != 1,
        f"expert_tensor_parallel_size {config.expert_tensor_parallel_size}": config.expert_tensor_parallel_size
        not in (None, 1),
        "token drops (moe_expert_capacity_factor)": config.moe_expert_capacity_factor is not None,
        "padding for quantization": bool(config.moe_router_padding_for_quantization),
        "shared experts": bool(config.moe_shared_expert_intermediate_size),
    }
    named = [name for name, on in problems.items() if on]
    if not named:
        return ""
    return f"the local dispatcher keeps every expert on one rank without drops; not: {', '.join(named)}"


class LocalTokenDispatcher(MoETokenDispatcher):
    """Permutes tokens to their experts on this rank and back; no communication, no host sync."""

    def __init__(self, config, pg_collection):
        super().__init__(config=config, pg_collection=pg_collection)
        if self.ep_size != 1 or self.tp_size != 1:
            raise ValueError(f"LocalTokenDispatcher needs EP1·ETP1, not EP{self.ep_size}·ETP{self.tp_size}")
        self.topk = config.moe_router_topk

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        self.hidden_shape = hidden_states.shape
        tokens = hidden_states.view(-1, self.hidden_shape[-1])
        self.restore_shape = tokens.shape
        num_tokens, num_experts = routing_map.shape
        # (expert, token) pairs, expert-major and tokens ascending: masked_select's order.
        pairs = torch.nonzero_static(routing_map.T, size=num_tokens * self.topk)
        self.expert_of, self.token_of = pairs[:, 0], pairs[:, 1]
        self.routing_map = routing_map
        self.tokens_per_expert = routing_map.sum(dim=0).long()
        permuted_probs = probs.T.contiguous().view(-1).index_select(0, self.expert_of * num_tokens + self.token_of)
        return tokens.index_select(0, self.token_of), permuted_probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return hidden_states, tokens_per_expert, probs

    def combine_preprocess(self, hidden_states: torch.Tensor):
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor, async_finish: bool = True, allocate_on_comm_stream=False):
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor):
        output = unpermute(hidden_states, self.token_of, restore_shape=self.restore_shape, routing_map=self.routing_map)
        return output.view(self.hidden_shape)


class LocallyDispatchedMoELayer(MoELayer):
    """Megatron's MoELayer with :class:`LocalTokenDispatcher` in place of its own."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
        if pg_collection is None:  # as MoELayer resolves it
            pg_collection = get_default_pg_collection()
        super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection)
        self.token_dispatcher = LocalTokenDispatcher(self.config, pg_collection)
