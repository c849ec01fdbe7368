"""Environments for multi-turn, tool-using episodes: what the model acts in and the tools it calls."""
