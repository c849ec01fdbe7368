"""Model dtype names: the one table between the config's names, torch, vLLM and Hugging Face.

The config, the command lines and Megatron's builder say ``fp32 | bf16 | fp16`` (short
names). vLLM's ``dtype`` argument and an HF ``config.json`` say ``float32 | bfloat16 |
float16`` (long names, also torch's attribute names). Every conversion between them goes
through here, so adding a dtype is one line.

Not the checkpoint store's on-disk tags (:data:`megatron_rl.checkpoint.format.DTYPES`),
which name every tensor dtype a checkpoint may hold (integers, bool, float64) and are part
of the file format, nor safetensors' tags (``F32``, ``BF16``; :mod:`megatron_rl.bridge.hf_files`).

torch is imported only by :func:`to_torch`: the config checks names before torch is loaded,
so a bad ``model.dtype`` fails in a fraction of a second.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    import torch

#: short name -> long name, in the order the names are listed to users.
_LONG_OF = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_SHORT_OF = {long: short for short, long in _LONG_OF.items()}

SHORT_NAMES: tuple[str, ...] = tuple(_LONG_OF)
"""What the config (``model.dtype``) and the command lines accept."""
LONG_NAMES: tuple[str, ...] = tuple(_SHORT_OF)
"""What vLLM (``LLM(dtype=...)``, :class:`megatron_rl.rollout.EngineConfig`) and HF configs say."""

Name = Union[str, "torch.dtype"]


def _text(name: Name) -> str:
    """A name as text: strings as given, a torch dtype as its attribute name."""
    return name if isinstance(name, str) else str(name).removeprefix("torch.")


def short_name(name: Name) -> str:
    """``'bf16'`` for ``'bf16'``, ``'bfloat16'`` or ``torch.bfloat16``; ValueError otherwise."""
    text = _text(name)
    if text in _LONG_OF:
        return text
    if text in _SHORT_OF:
        return _SHORT_OF[text]
    raise ValueError(
        f"dtype {name!r} is not supported; choose one of {', '.join(SHORT_NAMES)} (or {', '.join(LONG_NAMES)})"
    )


def long_name(name: Name) -> str:
    """The vLLM / HF string: ``'bfloat16'`` for ``'bf16'``, ``'bfloat16'`` or ``torch.bfloat16``."""
    return _LONG_OF[short_name(name)]


def to_torch(name: Name) -> torch.dtype:
    """The torch dtype of any accepted name (``torch.bfloat16`` for ``'bf16'``)."""
    import torch

    return getattr(torch, long_name(name))
