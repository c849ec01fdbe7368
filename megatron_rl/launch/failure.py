"""One line naming the rank and node a training process failed on, and why.

A failed multi-node job prints a traceback per rank; the line that matters on a cluster is
which rank on which node gave up, and whether it gave up waiting for a peer (a node down or
its network cut: the collective ran into trainer.dist_timeout_s) or lost the connection to
one (the peer's process died). Gloo names the peer's address in the second case; it is
resolved to the host name here.
"""

from __future__ import annotations

import os
import re
import socket

from megatron_rl.launch.slurm_env import SlurmEnv

_PEER = re.compile(r"\[(\d+\.\d+\.\d+\.\d+)\]:\d+")


def _host_of(addr: str) -> str:
    try:
        return f"{addr} ({socket.gethostbyaddr(addr)[0]})"
    except OSError:
        return addr


def describe_failure(err: BaseException, dist_timeout_s: float | None = None, environ=None) -> str:
    """``rank R on NODE failed: <cause>: <first line of the error>``."""
    env = os.environ if environ is None else environ
    rank = env.get("RANK") or env.get("SLURM_PROCID") or "0"
    node = SlurmEnv.from_environ(env).node
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if "Timed out waiting" in text or "timed out" in text.lower():
        bound = f"trainer.dist_timeout_s={dist_timeout_s:g}" if dist_timeout_s else "the process group timeout"
        cause = f"a collective waited longer than {bound} for a peer (node down or network cut?)"
    elif "Connection reset" in text or "Connection closed" in text:
        peer = _PEER.search(text)
        cause = f"lost the connection to {'peer ' + _host_of(peer.group(1)) if peer else 'a peer'} (its process died?)"
    else:
        cause = type(err).__name__
    return f"megatron-rl: rank {rank} on {node} failed: {cause}: {text}"
