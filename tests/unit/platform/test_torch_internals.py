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
