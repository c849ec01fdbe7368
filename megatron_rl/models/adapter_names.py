"""How LoRA adapters are named in a model's parameters (models.lora), for the code that must
tell them from the base without importing Megatron (the bridge's export, checkpoints)."""

ADAPTER_SUFFIX = "_lora"
"""``linear_qkv``'s adapter is the module ``linear_qkv_lora`` beside it."""


def is_adapter_name(name: str) -> bool:
    """Whether a parameter (or canonical tensor) name is an adapter's, not the base model's."""
    return f"{ADAPTER_SUFFIX}." in name
