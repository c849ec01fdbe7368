"""Multi-turn, tool-using episodes: the environments that answer a policy's turns, the tool
calls they parse, the token-in-token-out episode, and the sandbox the Python tool runs in."""
