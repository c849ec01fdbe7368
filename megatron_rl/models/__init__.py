"""Actor (GPTModel + LM head) and critic (GPTModel + value head), dense and MoE.

The builder imports torch and Megatron; it is loaded on first use so that reading a model
config stays cheap.
"""

from megatron_rl.models.hf_config import FAMILIES, ModelArch, UnsupportedModelError, arch_from_hf

_BUILDER = ("BuildOptions", "build_model", "padded_vocab_size", "transformer_config")

__all__ = ["FAMILIES", "ModelArch", "UnsupportedModelError", "arch_from_hf", *_BUILDER]


def __getattr__(name):
    if name in _BUILDER:
        from megatron_rl.models import builder

        return getattr(builder, name)
    raise AttributeError(name)
