"""Each part of the CPU layer is needed: Megatron fails without it and works with it.

Global patches of Megatron functions are checked in-process; device-scope rules are checked
by running one step of the model smoke job in a subprocess with the rule switched off;
patches only reached with several ranks are checked in tests/distributed/test_cpu_patches.py.
"""

import os
import subprocess
import sys

import pytest
import torch

from megatron_rl import platform
from megatron_rl.platform import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU layer only")


@pytest.fixture
def layer():
    platform.current()  # installs everything
    yield
    cpu_compat.install()


def test_every_patch_documents_what_it_covers():
    for patch in cpu_compat.PATCHES:
        assert patch.covers and patch.module.startswith("megatron.core")
    assert cpu_compat.MEGATRON_CORE_VERSION == "0.16.1"


def test_rng_tracker_forks_cpu_generator(layer):
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(5, tp_rank=1, ep_rank=0, etp_rank=0, force_reset_rng=True)
    torch.manual_seed(99)
    before = torch.get_rng_state()
    with tensor_parallel.get_cuda_rng_tracker().fork():
        drawn = torch.rand(4)
    # Megatron's TP seed is seed + 2718 + tp_rank; the fork must draw from exactly that.
    expected = torch.Generator().manual_seed(5 + 2718 + 1)
    assert torch.equal(drawn, torch.rand(4, generator=expected))
    assert torch.equal(torch.get_rng_state(), before), "fork must restore the default state"
    with tensor_parallel.get_cuda_rng_tracker().fork():
        second = torch.rand(4)
    assert not torch.equal(second, drawn), "the forked state must advance between forks"


def test_rng_tracker_fails_without_patch(layer):
    from megatron.core import tensor_parallel

    cpu_compat.uninstall()
    with pytest.raises((RuntimeError, AssertionError), match="CUDA"):
        tensor_parallel.model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)


def test_all_rng_states_round_trip(layer):
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom

    tensor_parallel.model_parallel_cuda_manual_seed(3, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    states = mrandom._get_all_rng_states()  # what activation recompute saves
    first = torch.rand(3)
    mrandom._set_all_rng_states(*states)
    assert torch.equal(torch.rand(3), first)
    cpu_compat.install(exclude=("rng_get_state",))
    with pytest.raises((RuntimeError, AssertionError), match="CUDA"):
        mrandom._get_all_rng_states()


def test_recompute_backward_runs_in_the_device_scope(layer):
    """Activation recompute re-runs a layer's forward inside autograd's backward, where the
    scope's torch function mode is not active: a CUDA device argument there (Megatron's
    default causal mask) fails unless the patch enters the scope again."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(3, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)

    def layer_forward(x):
        return x * torch.arange(1.0, 4.0, device="cuda")

    x = torch.ones(3, requires_grad=True)
    with platform.megatron_scope():
        tensor_parallel.checkpoint(layer_forward, False, x).sum().backward()
    assert torch.equal(x.grad, torch.tensor([1.0, 2.0, 3.0]))
    cpu_compat.install(exclude=("recompute_backward_scope",))
    with pytest.raises((RuntimeError, AssertionError), match="CUDA"):
        with platform.megatron_scope():
            tensor_parallel.checkpoint(layer_forward, False, x).sum().backward()


def test_type_strings_rule_inside_scope_only(layer):
    with platform.megatron_scope():
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
        assert torch.zeros(1, device="cuda").device.type == "cpu"
        assert torch.cuda.current_device() == torch.device("cpu")
    assert torch.zeros(1).type() == "torch.FloatTensor"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_device()


class _TwoRankGroup:
    """The two methods Megatron's rotary split reads from a CP group (rank 1 of 2)."""

    def size(self):
        return 2

    def rank(self):
        return 1


def test_pin_memory_rule_lets_the_cp_rotary_split_run(layer):
    """Megatron 0.16.1 builds its CP chunk index with pin_memory=True then .cuda(): without the
    rule the CPU build refuses; with it rank 1 of CP2 gets chunks 1 and 2 of 4 (of 8 positions)."""
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

    positions = torch.arange(8.0).reshape(8, 1, 1, 1)
    with platform.megatron_scope():
        mine = get_pos_emb_on_this_cp_rank(positions, 0, _TwoRankGroup())
    assert mine.flatten().tolist() == [2.0, 3.0, 4.0, 5.0]
    cpu_compat.install(exclude=("mode.pin_memory",))
    try:
        with pytest.raises(RuntimeError, match="pin_memory"):
            with platform.megatron_scope():
                get_pos_emb_on_this_cp_rank(positions, 0, _TwoRankGroup())
    finally:
        cpu_compat.install()


def test_unknown_patch_name_is_refused():
    with pytest.raises(ValueError, match="unknown CPU patch"):
        cpu_compat.install(exclude=("no_such_patch",))
    cpu_compat.install()


def test_synchronize_is_a_no_op_inside_scope_only():
    """The pipeline's shape exchange (variable_seq_lengths) calls torch.cuda.synchronize."""
    with platform.megatron_scope():
        torch.cuda.synchronize()
    with pytest.raises((RuntimeError, AssertionError), match="CUDA"):
        torch.cuda.synchronize()
    cpu_compat.install(exclude=("cuda.synchronize",))
    try:
        with pytest.raises((RuntimeError, AssertionError), match="CUDA"):
            with platform.megatron_scope():
                torch.cuda.synchronize()
    finally:
        cpu_compat.install()


def _smoke_step(exclude: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MEGATRON_RL_CPU_PATCHES_EXCLUDE=exclude, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "megatron_rl",
        "train",
        "--config",
        "examples/smoke.yaml",
        "trainer.max_steps=1",
        "trainer.run_dir=/tmp/mrl-scope-test",
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize(
    "rule, error",
    [
        ("cuda.current_device", "not compiled with CUDA"),
        ("cuda.current_stream", "not compiled with CUDA"),
        ("cuda.Stream", "requires CUDA support"),
        ("mode.device_args", "not compiled with CUDA"),
        ("mode.type_strings", "Wrapped parameters must be one of torch.cuda.FloatTensor"),
    ],
)
def test_scope_rule_is_needed(rule, error):
    proc = _smoke_step(rule)
    assert proc.returncode != 0 and error in proc.stderr, proc.stderr[-2000:]
