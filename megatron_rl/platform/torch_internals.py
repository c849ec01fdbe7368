"""Accessors for torch 2.13.0 internals that megatron_rl reads.

Each is the one place that knows the private name, says which release it was read from
and why it is needed, and is tested against the installed release in
tests/unit/platform/test_torch_internals.py.
"""

from __future__ import annotations

TORCH_VERSION = "2.13.0"
"""The torch release these accessors were read from."""


def is_registered_process_group(group) -> bool:
    """Whether torch.distributed still holds ``group`` (it has not been destroyed).

    Read from ``distributed_c10d._world.pg_map`` (torch 2.13.0), the registry
    ``destroy_process_group`` removes a group from; torch has no public query, and
    destroying a group twice raises. Megatron-Core destroys some of a layout's groups
    itself (its gloo ones) and only forgets the others, which :func:`megatron_rl.parallel.destroy`
    then destroys."""
    from torch.distributed.distributed_c10d import _world

    return group in _world.pg_map
