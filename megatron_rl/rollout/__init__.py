"""Rollouts with vLLM colocated with training, and the weight sync into it.

Loaded lazily: importing vLLM takes seconds and is only needed by ranks that roll out;
the plain values (:mod:`megatron_rl.rollout.types`) load without it.
"""

_TYPES = ("EngineConfig", "EvalSamples", "Sample", "Sampling")
_ENGINE = ("RolloutEngine",)
_ADAPTIVE_TEMPERATURE = ("AdaptiveTemperatureProcessor",)

__all__ = list(_TYPES + _ENGINE + _ADAPTIVE_TEMPERATURE)


def __getattr__(name):
    if name in _TYPES:
        from megatron_rl.rollout import types

        return getattr(types, name)
    if name in _ENGINE:
        from megatron_rl.rollout import engine

        return getattr(engine, name)
    if name in _ADAPTIVE_TEMPERATURE:
        from megatron_rl.rollout import adaptive_temperature

        return getattr(adaptive_temperature, name)
    raise AttributeError(name)
