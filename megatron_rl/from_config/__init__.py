"""A run built from its config: the checks that span sections, where the model and the
prompts come from, and the pieces built from them.

Below both :mod:`megatron_rl.trainer` and :mod:`megatron_rl.evaluation`, so the model a
layout is checked against is the one either of them builds. ``checks``, ``sources``,
``rows`` and ``loggers`` import no torch (a bad config fails in well under two seconds);
``setup`` builds models and is imported on its own.
"""

from megatron_rl.from_config.checks import check_recipe, validate
from megatron_rl.from_config.sources import base_settings, model_arch, model_shape, verifier_name

__all__ = ["base_settings", "check_recipe", "model_arch", "model_shape", "validate", "verifier_name"]
