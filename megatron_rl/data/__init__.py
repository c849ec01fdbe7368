"""Prompt data for RL: JSONL/Parquet rows or reasoning-gym entries (``data.reasoning_gym``)
-> chat-templated ids, a seeded resumable order, batches, and group expansion (each prompt
-> G samples)."""

from megatron_rl.data.batching import PromptBatch, PromptLoader
from megatron_rl.data.prompts import PromptDataset, PromptFields, PromptRecord, encode_prompt, parse_row
from megatron_rl.data.sampler import EpochSampler
from megatron_rl.data.sources import DatasetFormatError, read_rows

__all__ = [
    "DatasetFormatError",
    "EpochSampler",
    "PromptBatch",
    "PromptDataset",
    "PromptFields",
    "PromptLoader",
    "PromptRecord",
    "encode_prompt",
    "parse_row",
    "read_rows",
]
