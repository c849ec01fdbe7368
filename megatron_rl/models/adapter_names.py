"""What code outside models.lora needs of LoRA adapters without importing Megatron (the
bridge's export, the weight sync): how they are named in a model's parameters, and how one
folds into its base weight."""

import torch

TARGET_LINEARS = {
    "qkv": "self_attention.linear_qkv",
    "proj": "self_attention.linear_proj",
    "fc1": "mlp.linear_fc1",
    "fc2": "mlp.linear_fc2",
    "experts": "mlp.experts",
}
"""LoRA target name -> the Megatron linear it adapts in every decoder layer (its path in the
layer). fc1 and fc2 name dense MLPs; experts: FC1 and FC2 of every expert of a MoE layer."""

ADAPTER_SUFFIX = "_lora"
"""``linear_qkv``'s adapter is the module ``linear_qkv_lora`` beside it."""


def is_adapter_name(name: str) -> bool:
    """Whether a parameter (or canonical tensor) name is an adapter's, not the base model's."""
    return f"{ADAPTER_SUFFIX}." in name


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W + scaling · B A`` in float32, rounded once to W's dtype: what vLLM is synced with
    (models.lora.merged_into_weights) and what a merged HF export holds (bridge.lora_export)."""
    return (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)
