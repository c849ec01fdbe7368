"""CPU compatibility layer for Megatron-Core 0.16.1 (torch CPU build, gloo backend).

Megatron-Core hard-codes CUDA in a few dozen places. Rather than forking it, this module
patches exactly those touch points, each one a named :class:`Patch` (the form the vLLM
patches in :mod:`.vllm_compat` share) that states the Megatron function it covers and why. The layer has two parts:

* global patches (``install``) replace Megatron's *own* functions/classes; they cost
  nothing outside Megatron and stay on for the life of the process;
* the device scope (``cuda_to_cpu_scope``) maps ``device="cuda"``, ``.cuda()``,
  ``torch.cuda.current_device()``, streams and events to CPU equivalents. It is a context
  manager entered around Megatron calls only, because a process-wide interception slows
  vLLM (colocated in the same process) by ~40%.

Only :mod:`megatron_rl.platform` imports this module, and only when no GPU is present.
Every patch has a test (tests/unit/platform/test_cpu_compat.py) that fails without it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

from megatron_rl.platform.patch import Patch

MEGATRON_CORE_VERSION = "0.16.1"
CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------
# RNG: Megatron tracks named CUDA generator states; on CPU the default CPU generator plays
# that role (fork swaps its state in and out exactly as the CUDA tracker does).


def _make_cpu_rng_tracker(original_cls):
    class CpuRNGStatesTracker(original_cls):
        """CudaRNGStatesTracker whose states are CPU generator states."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig_state, orig_name = torch.get_rng_state(), self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

    return CpuRNGStatesTracker


def _cpu_get_rng_state(original):
    def get_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    return get_rng_state


# ---------------------------------------------------------------------------------------
# MoE all-to-all: the dispatcher expects split sizes on the host (numpy); the helper only
# converts CUDA tensors, so CPU tensors reach all_to_all_single as tensors.


def _host_splits(original):
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor):
            return tensor.detach().cpu().numpy()
        return tensor

    return maybe_move_tensor_to_cpu


# ---------------------------------------------------------------------------------------
# Uneven all-gather along dim 0 (alltoall dispatcher with ETP>1): Megatron gathers pieces
# of different lengths with dist.all_gather, which NCCL accepts but gloo rejects
# ("invalid tensor size"). Pad to the largest piece, run the even collective, trim.
# (The matching uneven reduce-scatter in backward works on gloo as it is.)


def _padded_uneven_gather(original):
    import torch.distributed as dist

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        world = group.size()
        if world == 1:
            return input_
        if output_split_sizes is None:
            return original(input_, group, None, use_global_buffer)
        width = max(output_split_sizes)
        padded = input_.new_zeros((width,) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        gathered = input_.new_empty((width * world,) + tuple(input_.shape[1:]))
        dist.all_gather_into_tensor(gathered, padded.contiguous(), group=group)
        pieces = [gathered[r * width : r * width + n] for r, n in enumerate(output_split_sizes)]
        return torch.cat(pieces, dim=0)

    return _gather_along_first_dim


def _recompute_in_device_scope(original):
    """Run a recomputing backward inside the device scope: autograd runs backward functions
    without the caller's torch function modes, so the scope entered around the schedule is
    not active when CheckpointFunction.backward re-runs the layer's forward."""
    backward = original.__func__ if isinstance(original, staticmethod) else original

    def checkpoint_backward(ctx, *grads):
        with cuda_to_cpu_scope():
            return backward(ctx, *grads)

    return staticmethod(checkpoint_backward)


PATCHES: list[Patch] = [
    Patch(
        "rng_tracker",
        "megatron.core.tensor_parallel.random",
        "CudaRNGStatesTracker",
        "tensor_parallel.random.CudaRNGStatesTracker.add/fork (model_parallel_cuda_manual_seed,"
        " dropout and init under get_cuda_rng_tracker().fork())",
        _make_cpu_rng_tracker,
    ),
    Patch(
        "rng_get_state",
        "megatron.core.tensor_parallel.random",
        "_get_cuda_rng_state",
        "tensor_parallel.random._get_all_rng_states (activation recompute, checkpoints); the matching"
        " _set_cuda_rng_state is a silent no-op on the CPU build and the CPU state is restored beside it,"
        " so it needs no patch",
        _cpu_get_rng_state,
    ),
    Patch(
        "a2a_host_splits",
        "megatron.core.transformer.moe.token_dispatcher",
        "maybe_move_tensor_to_cpu",
        "moe.token_dispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
        _host_splits,
    ),
    Patch(
        "uneven_all_gather",
        "megatron.core.tensor_parallel.mappings",
        "_gather_along_first_dim",
        "tensor_parallel.mappings._gather_along_first_dim with output_split_sizes (gloo)",
        _padded_uneven_gather,
    ),
    Patch(
        "recompute_backward_scope",
        "megatron.core.tensor_parallel.random",
        "CheckpointFunction.backward",
        "tensor_parallel.random.CheckpointFunction.backward (activation recompute: full, and "
        "selective of the MoE layer), which re-runs the forward during the backward pass",
        _recompute_in_device_scope,
        why="the device scope is a torch function mode, and autograd does not carry modes into "
        "backward functions: the recomputed forward meets device='cuda' (the causal mask) and fails",
    ),
]


def patch_names() -> list[str]:
    """Every part of the layer that can be switched off by name (for the tests)."""
    return [p.name for p in PATCHES] + [f"cuda.{n}" for n in _CUDA_ATTRIBUTES] + list(MODE_RULES)


# Parts of the device scope switched off (tests show each one is needed).
_disabled: set[str] = set()


def install(exclude: tuple[str, ...] = ()) -> None:
    """Apply every global patch and scope rule except those named in ``exclude``."""
    unknown = set(exclude) - set(patch_names())
    if unknown:
        raise ValueError(f"unknown CPU patch {sorted(unknown)}; known: {patch_names()}")
    _disabled.clear()
    _disabled.update(exclude)
    for patch in PATCHES:
        patch.revert() if patch.name in exclude else patch.apply()
    _reset_rng_tracker()


def uninstall() -> None:
    """Revert every global patch (used by tests that show a patch is needed)."""
    for patch in reversed(PATCHES):
        patch.revert()
    _reset_rng_tracker()


def _reset_rng_tracker() -> None:
    # The tracker instance is created lazily from the (possibly patched) class.
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


# ---------------------------------------------------------------------------------------
# The device scope.


class _DummyStream:
    """Stands in for torch.cuda.Stream/Event: everything on CPU is already in order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _DummyStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0

    def __eq__(self, other):
        return isinstance(other, _DummyStream)

    def __hash__(self):
        return 0


_CPU_STREAM = _DummyStream()

# torch.cuda attributes that Megatron calls on the paths we run; inside the scope they act
# on the CPU. Measured necessary (tests/unit/platform): current_device (rotary, p2p,
# mappings, router, param_and_grad_buffer...), current_stream and Stream (MoE alltoall
# dispatcher's device-to-host split transfer), synchronize (the pipeline's shape exchange
# before each send when micro-batches differ in length: p2p_communication's
# `_communicate_shapes` under `variable_seq_lengths`; CPU work is synchronous, so a no-op).
# Others Megatron names (Event, stream, empty_cache) are not reached or already harmless.
_CUDA_ATTRIBUTES: dict[str, object] = {
    "current_device": lambda: CPU,
    "current_stream": lambda *a, **k: _CPU_STREAM,
    "Stream": _DummyStream,
    "synchronize": lambda *a, **k: None,
}


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is a CUDA ordinal (torch.cuda.current_device() style).
    return isinstance(device, int) and not isinstance(device, bool)


MODE_RULES = {
    "mode.device_args": "device='cuda' / .cuda() / .to('cuda') / int ordinals in torch calls "
    "(schedules' total_num_tokens, causal masks, clip_grads, optimizer init, p2p buffers)",
    "mode.type_strings": "`.type() == 'torch.cuda.FloatTensor'` filters in clip_grads, "
    "optimizer and distrib_optimizer (CPU tensors reported under the CUDA type names)",
    "mode.pin_memory": "pin_memory=True in torch calls (context parallelism's rotary "
    "embedding split, rope_utils.get_pos_emb_on_this_cp_rank): pinned host memory needs an "
    "accelerator, and on the CPU the tensor is host memory already",
}


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of torch calls to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "mode.device_args" not in _disabled:
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.to and args:
                args = tuple(CPU if _is_cuda_device(a) else a for a in args)
            if "device" in kwargs and _is_cuda_device(kwargs["device"]):
                kwargs = dict(kwargs, device=CPU)
        if "mode.pin_memory" not in _disabled and kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        if "mode.type_strings" not in _disabled and func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not args[0].is_cuda else name
        return func(*args, **kwargs)


_scope_depth = 0


@contextlib.contextmanager
def cuda_to_cpu_scope() -> Iterator[None]:
    """Run Megatron code that assumes CUDA on the CPU (re-entrant)."""
    global _scope_depth
    if _scope_depth > 0:
        _scope_depth += 1
        # Nested: torch.cuda is already mapped; the mode too, unless autograd runs a
        # backward function (modes are not carried into those: recompute_backward_scope).
        mode_active = any(isinstance(m, _CudaToCpuMode) for m in torch.overrides._get_current_function_mode_stack())
        try:
            with contextlib.nullcontext() if mode_active else _CudaToCpuMode():
                yield
        finally:
            _scope_depth -= 1
        return
    active = {n: v for n, v in _CUDA_ATTRIBUTES.items() if f"cuda.{n}" not in _disabled}
    saved = {name: getattr(torch.cuda, name) for name in active}
    for name, value in active.items():
        setattr(torch.cuda, name, value)
    _scope_depth = 1
    try:
        with _CudaToCpuMode():
            yield
    finally:
        _scope_depth = 0
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
