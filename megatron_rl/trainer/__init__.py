"""The RL trainer: the loop, its setup, rollouts and metrics (see DESIGN.md)."""


def train(cfg):
    from megatron_rl.trainer.loop import train as _train

    return _train(cfg)


__all__ = ["train"]
