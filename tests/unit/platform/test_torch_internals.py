"""The torch accessors of the platform layer read what torch 2.13.0 has, where it has it."""

import subprocess
import sys
import textwrap

from megatron_rl.platform import torch_internals


def test_a_process_group_is_registered_until_destroyed(tmp_path):
    """In a process of its own: a default group changes torch.distributed for the whole process."""
    script = textwrap.dedent(f"""
        import torch.distributed as dist
        from megatron_rl.platform.torch_internals import is_registered_process_group

        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        group = dist.new_group([0])
        before = is_registered_process_group(group)
        dist.destroy_process_group(group)
        print(before, is_registered_process_group(group))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "False"]


def test_the_accessor_names_the_release_it_was_read_from():
    import torch

    assert torch.__version__.startswith(torch_internals.TORCH_VERSION) or torch.cuda.is_available()
    assert torch_internals.TORCH_VERSION in torch_internals.is_registered_process_group.__doc__


def test_grouped_mm_is_one_matmul_per_group_and_takes_an_expanded_gradient():
    """Against one matmul per group (rows 0-3, none, 3-7, 7-10), values and both gradients;
    ``sum()`` hands back an expanded gradient, which the raw kernel refuses."""
    import torch

    assert torch_internals.has_grouped_mm()
    seeded = torch.Generator().manual_seed(0)
    rows = torch.randn(10, 8, generator=seeded, requires_grad=True)
    weights = torch.randn(4, 8, 4, generator=seeded, requires_grad=True)
    bounds = [(0, 3), (3, 3), (3, 7), (7, 10)]
    torch_internals.grouped_mm(rows, weights, torch.tensor([3, 3, 7, 10], dtype=torch.int32)).sum().backward()
    got = rows.grad.clone(), weights.grad.clone()
    rows.grad = weights.grad = None
    torch.cat([rows[a:b] @ weights[g] for g, (a, b) in enumerate(bounds)]).sum().backward()
    assert torch.allclose(got[0], rows.grad, rtol=1e-6, atol=1e-6)
    assert torch.allclose(got[1], weights.grad, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[1][1], torch.zeros(8, 4))


def test_inductors_cache_dir_and_the_vec_isa_probe_fingerprint(tmp_path, monkeypatch):
    import torch
    from torch._inductor.cpu_vec_isa import VecAVX2

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert torch_internals.inductor_cache_dir() == str(tmp_path / "inductor")
    fingerprint = torch_internals.vec_isa_probe_fingerprint(VecAVX2())
    assert VecAVX2().build_arch_flags() in fingerprint and torch.__version__ in fingerprint
