"""A tiny byte-level BPE tokenizer trained on the task's own text, saved for HF loaders.

Byte-level, so any text (a math prompt too) still encodes; merges learned from the task
text keep prompts short. Saved as a ``PreTrainedTokenizerFast`` directory with the chat
template and eos/pad tokens, so vLLM, transformers and the trainer load the same files.
"""

from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from megatron_rl.tasks.chat_format import CHAT_TEMPLATE, END, PAD, SPECIAL_TOKENS


def train_tokenizer(texts: Iterable[str], vocab_size: int = 320, individual_digits: bool = False):
    """Train on ``texts`` and wrap as a transformers ``PreTrainedTokenizerFast``.

    ``individual_digits``: every digit is a token of its own (as in Qwen's tokenizer), so a
    number is the same tokens wherever it stands (a tool's output and the answer copying it).

    The trainer sees the texts in the given order and is single-threaded here
    (``RAYON_NUM_THREADS`` is not needed: ``tokenizers`` BPE merges are deterministic
    for a fixed corpus), so the same texts give the same vocabulary.
    """
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if individual_digits
        else byte_level
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=END,
        pad_token=PAD,
        padding_side="left",  # prompts are generated from: left padding keeps them adjacent
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
