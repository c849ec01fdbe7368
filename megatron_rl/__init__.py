"""megatron_rl: reinforcement learning for reasoning LLMs on Megatron-Core, with vLLM rollouts."""

__version__ = "0.1.0"
