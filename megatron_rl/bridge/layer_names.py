"""Which decoder layer a tensor belongs to, from its name: the one place for these rules.

Megatron and HF/vLLM name layers differently, so there are two rules, not one:

- Megatron parameters: ``decoder.layers.<N>.`` at the very start of the name (the model
  chunks' own ``named_parameters``); the layer *index* orders the export.
- HF tensors and vLLM parameters: ``<anything>layers.<N>.``; the layer *prefix* (``model.layers.3``)
  is the key that keeps a layer together in one bucket and matches an HF tensor to the vLLM
  modules it loads into, so HF and vLLM names must give the same prefix.
"""

from __future__ import annotations

import re
from typing import Optional

_MEGATRON_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_HF_LAYER = re.compile(r"^(.*?layers\.\d+)\.")


def megatron_layer_index(name: str) -> Optional[int]:
    """``3`` for any Megatron parameter of decoder layer 3 (``decoder.layers.3.…``); None
    outside the layers (embedding, final norm, output layer)."""
    match = _MEGATRON_LAYER.match(name)
    return int(match.group(1)) if match else None


def hf_layer_prefix(name: str) -> Optional[str]:
    """``model.layers.3`` for any HF tensor or vLLM parameter of decoder layer 3; None
    outside the layers.

    Any prefix before ``layers.<N>`` is accepted because vLLM may nest the HF module names
    (a multimodal model's ``language_model.model.layers.3``); the first ``layers.<N>`` wins.
    """
    match = _HF_LAYER.match(name)
    return match.group(1) if match else None
