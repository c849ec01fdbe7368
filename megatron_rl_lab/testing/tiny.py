"""The tests' tiny models by role, as names of the runtime's one preset table (models.presets).

Head size 32 (the smallest vLLM's CPU attention accepts), GQA, 4 layers, so every layout of
the distributed tests divides them. "moe" has a shared expert beside the routed ones
(qwen2_moe), so the layout tests cover it; tiny-moe-4l (qwen3_moe) is the MoE that also
exists as a transformers/vLLM model (testing.hf_models writes qwen3 and qwen3_moe).
"""

from megatron_rl.models.presets import PRESETS

ROLES = {"dense": "tiny-dense-4l", "moe": "tiny-moe-shared-4l"}
"""role -> preset name: the models the layout, schedule and training tests build."""

TINY_ARCHS = {role: PRESETS[name] for role, name in ROLES.items()}
TINY_DENSE, TINY_MOE = TINY_ARCHS["dense"], TINY_ARCHS["moe"]
TINY_QWEN3_MOE = PRESETS["tiny-moe-4l"]
