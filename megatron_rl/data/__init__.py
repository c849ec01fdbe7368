"""Prompt data for RL: JSONL/Parquet rows or reasoning-gym entries (``data.reasoning_gym``)
-> chat-templated ids, a seeded resumable order, batches, and group expansion (each prompt
-> G samples); preference pairs for reward models (``data.pairs``)."""

from megatron_rl.data.batching import PromptBatch, PromptLoader
from megatron_rl.data.pairs import PreferencePair, encode_conversation, read_pairs
from megatron_rl.data.prompts import PromptDataset, PromptFields, PromptRecord, encode_prompt, parse_row
from megatron_rl.data.sampler import EpochSampler
from megatron_rl.data.sources import DatasetFormatError, read_rows

__all__ = [
    "DatasetFormatError",
    "EpochSampler",
    "PreferencePair",
    "PromptBatch",
    "PromptDataset",
    "PromptFields",
    "PromptLoader",
    "PromptRecord",
    "encode_conversation",
    "encode_prompt",
    "parse_row",
    "read_pairs",
    "read_rows",
]
