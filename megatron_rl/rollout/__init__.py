"""Rollouts with vLLM colocated with training, and the weight sync into it.

Loaded lazily: importing vLLM takes seconds and is only needed by ranks that roll out.
"""

_ENGINE = ("EngineConfig", "RolloutEngine", "Sample", "Sampling")

__all__ = list(_ENGINE)


def __getattr__(name):
    if name in _ENGINE:
        from megatron_rl.rollout import engine

        return getattr(engine, name)
    raise AttributeError(name)
