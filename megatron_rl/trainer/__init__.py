"""The RL trainer: :class:`~megatron_rl.trainer.trainer.RLTrainer` runs one method per phase of
a step; rollout sources, batch assembly, advantages, run checkpoints and metrics are its
parts (docs/design.md, "The trainer")."""


def train(cfg):
    from megatron_rl.trainer.entry import train as _train

    return _train(cfg)


__all__ = ["train"]
