"""HF <-> Megatron bridge: one declarative table per model family, streaming both ways.

- :func:`load_hf`: HF safetensors -> a sharded Megatron model in any TP/PP/VPP/EP/ETP
  layout; each rank reads only its slices (no collectives).
- :func:`iter_hf_tensors`: the model -> (HF name, full tensor) pairs on every rank, one
  small unit at a time (collective); :func:`iter_hf_buckets`: the same in layer-aligned
  buckets of views into one reused buffer (the vLLM weight sync).
- :func:`save_hf`: the model -> an HF directory transformers and vLLM load.

The exports take an :class:`ExportPlans` to keep their plan and buffers from one call to
the next (the weight sync owns one); without it each call plans afresh.
"""

from megatron_rl.bridge.export import ExportPlans, iter_hf_buckets, iter_hf_tensors, save_hf
from megatron_rl.bridge.export_plan import ExportPlan
from megatron_rl.bridge.families import EXPERT_STYLES, FUSED, PER_EXPERT, SUPPORTED_FAMILIES, detect_style, rules_for
from megatron_rl.bridge.load import load_hf, tensor_map
from megatron_rl.bridge.mapping import BridgeError

__all__ = [
    "BridgeError",
    "EXPERT_STYLES",
    "ExportPlan",
    "ExportPlans",
    "FUSED",
    "PER_EXPERT",
    "SUPPORTED_FAMILIES",
    "detect_style",
    "iter_hf_buckets",
    "iter_hf_tensors",
    "load_hf",
    "rules_for",
    "save_hf",
    "tensor_map",
]
