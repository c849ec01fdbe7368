"""Parallel layout: ParallelConfig (validated with no process group) and its initialisation.

The process-group half (``state``) imports torch and Megatron; it is loaded on first use so
that config validation stays fast.
"""

from megatron_rl.parallel.config import LayoutError, ModelShape, ParallelConfig

_STATE = (
    "ParallelContext",
    "RankCoordinates",
    "destroy",
    "format_rank_map",
    "initialize",
    "initialize_alongside",
    "rank_map",
)

__all__ = ["LayoutError", "ModelShape", "ParallelConfig", *_STATE]


def __getattr__(name):
    if name in _STATE:
        from megatron_rl.parallel import state

        return getattr(state, name)
    raise AttributeError(name)
