"""A reward model's HF form: transformers' ``<Family>ForSequenceClassification`` with one label.

A reward model (``algorithm.recipe=reward_model``) is the critic's network: the GPT backbone
and a scalar head ``output_layer`` (weight [1, hidden], bias [1]); its reward is the head's
value at the conversation's last token. HF's sequence classifier is the same backbone
(under ``model.``) and a bias-free ``score`` layer read at the last token that is not the
pad token, so the export is the causal-LM export with the LM head swapped for the score
head (:func:`megatron_rl.bridge.families.with_score_head`) and this config.

The bias has no HF counterpart. The Bradley-Terry loss reads only r_chosen - r_rejected,
in which the bias cancels, so its gradient is exactly zero and a trained reward model keeps
the zero it was initialised with: dropping it changes no score. A bias that is not zero
(set by hand, or another objective) would shift every score, so the export refuses it
rather than change them silently.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rl.bridge.mapping import BridgeError

HEAD_BIAS = "output_layer.bias"
"""The stored name of the scalar head's bias (models.value_head.ValueHead)."""


def check_zero_bias(bias: Optional[torch.Tensor], where: str) -> None:
    """Refuse a head bias that is not exactly zero (HF's score layer has none)."""
    if bias is None or not torch.any(bias != 0):
        return
    raise BridgeError(
        f"{where}: the reward model's head bias is {bias.flatten().tolist()}, not 0, and HF's "
        "*ForSequenceClassification score layer has no bias: the export would shift every score by it "
        "(Bradley-Terry training never moves the zero-initialised bias; was it changed elsewhere?)"
    )


def architecture(model_type: str) -> str:
    """transformers' sequence-classification class of ``model_type`` (e.g. Qwen3ForSequenceClassification)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as NAMES

    if model_type not in NAMES:
        raise BridgeError(f"transformers has no sequence-classification model for model_type {model_type!r}")
    return NAMES[model_type]


def config(hf_config: dict, pad_token_id: int) -> dict:
    """The causal LM's HF config as a one-label sequence classifier's.

    ``pad_token_id`` is required: HF pools each row at its last token that is not the pad
    token (no pad id: batches of one only). ``problem_type="regression"`` says the score is
    a raw scalar: vLLM's classify pooler then applies no activation (it would apply a
    sigmoid to one label otherwise), and HF's loss for one label is the regression one."""
    return dict(
        hf_config,
        architectures=[architecture(hf_config["model_type"])],
        num_labels=1,
        id2label={"0": "LABEL_0"},
        label2id={"LABEL_0": 0},
        problem_type="regression",
        pad_token_id=pad_token_id,
    )


def pad_token_id(hf_config: dict, tokenizer_dir: Optional[str]) -> int:
    """The pad id the reward-model trainer padded with: its tokenizer's (``tokenizer_dir``,
    the source directory when it still has one), else the HF config's, else 0 (the
    trainer's fallback)."""
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        pad = AutoTokenizer.from_pretrained(tokenizer_dir).pad_token_id
        if pad is not None:
            return int(pad)
    configured = hf_config.get("pad_token_id")
    return int(configured) if configured is not None else 0
