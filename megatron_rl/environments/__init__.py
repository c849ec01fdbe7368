"""Multi-turn environments: what answers a policy's turns, and the tools it may call."""
