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


GROUPED_MM_ALIGNMENT = 16
"""Bytes every row of :func:`grouped_mm`'s operands must be a multiple of."""


def grouped_mm(rows, weights, group_ends):
    """``rows[start_g:end_g] @ weights[g]`` for every group g, as one kernel.

    torch.nn.functional has no public grouped GEMM in torch 2.13.0; ``torch._grouped_mm``
    (since 2.8) runs a CUTLASS grouped kernel on Hopper for bf16 and a per-group loop
    elsewhere. ``rows`` is [tokens, in], ``weights`` [groups, in, out], ``group_ends`` the
    int32 cumulative row counts (empty groups allowed); every row stride must be a multiple of
    16 bytes (:data:`GROUPED_MM_ALIGNMENT`). Its derivative needs a dense
    incoming gradient (an expanded one, as ``sum()`` gives, is refused), so the gradient is
    made contiguous on its way back."""
    import torch

    out = torch._grouped_mm(rows, weights, offs=group_ends)
    if out.requires_grad:
        out.register_hook(torch.Tensor.contiguous)
    return out


def has_grouped_mm() -> bool:
    """Whether this torch has :func:`grouped_mm`'s kernel."""
    import torch

    return hasattr(torch, "_grouped_mm")


def inductor_cache_dir() -> str:
    """The directory inductor keeps its compiled C++ kernels in: ``TORCHINDUCTOR_CACHE_DIR``,
    else its default under the temp dir (``torch._inductor.runtime.cache_dir_utils.cache_dir``,
    torch 2.13.0, which also creates it and exports the variable)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def vec_isa_probe_fingerprint(isa) -> str:
    """What decides whether a vector ISA's probe kernel builds and loads, besides its code:
    the C++ compiler's version, the ISA's compile flags and torch's version. Torch 2.13.0
    names the probe's compiled file by the same string
    (``torch._inductor.cpu_vec_isa._get_isa_dry_compile_fingerprint``)."""
    from torch._inductor.cpu_vec_isa import _get_isa_dry_compile_fingerprint

    return _get_isa_dry_compile_fingerprint(isa.build_arch_flags())
