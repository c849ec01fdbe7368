"""The torch patches of the platform layer, on the installed torch 2.13.0."""

import json
import os
import subprocess
import sys
import textwrap

import torch

from megatron_rl.platform import torch_compat

RANKS = """
import json, os, sys
import torch, torch.distributed as dist
import torch.multiprocessing as mp
from megatron_rl.platform import torch_compat


def loops():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return names.count("gloo_tcp_loop")


def sums(groups, rank):
    out = []
    for group in groups:
        x = torch.tensor([rank + 1.0])
        dist.all_reduce(x, group=group)
        out.append(x.item())
    return out


def rank_main(rank, store):
    torch_compat.install()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    shared = [dist.new_group([0, 1]) for _ in range(4)]
    report = {"shared": {"loops": loops(), "sums": sums(shared, rank)}}
    torch_compat.GLOO_SHARED_DEVICE.revert()
    own = [dist.new_group([0, 1]) for _ in range(4)]
    report["own"] = {"loops": loops(), "sums": sums(own, rank)}
    report["shared_again"] = sums(shared, rank)
    if rank == 0:
        print(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank_main, args=(sys.argv[1],), nprocs=2)
"""


def test_gloo_groups_share_one_event_loop_per_process_and_reduce_right(tmp_path):
    """World 2, two processes: the default group and four more share one gloo event-loop
    thread with the patch; with it reverted, each new group starts one of its own (the
    cost the patch removes). Every group sums 1 + 2 = 3, before and after the others exist."""
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(RANKS))
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["shared"] == {"loops": 1, "sums": [3.0] * 4}
    assert report["own"] == {"loops": 1 + 4, "sums": [3.0] * 4}
    assert report["shared_again"] == [3.0] * 4


def test_the_patch_names_the_release_it_was_written_for():
    assert torch.__version__.startswith(torch_compat.TORCH_VERSION) or torch.cuda.is_available()
    assert torch_compat.patch_names() == ["gloo_shared_device", "vec_isa_probe_memo"]
    assert all(patch.why for patch in torch_compat.PATCHES)


PICK_ISA = """
import json
import torch
from torch._inductor import cpu_vec_isa
from megatron_rl.platform import torch_compat

probes = []
original = cpu_vec_isa.VecISA._probe_load
cpu_vec_isa.VecISA._probe_load = lambda self, path: probes.append(path) or original(self, path)
torch_compat.VEC_ISA_PROBE_MEMO.apply()
isa = cpu_vec_isa.pick_vec_isa()
print(json.dumps({"isa": str(isa), "flags": isa.build_arch_flags(), "probes": len(probes)}))
"""


def test_a_vec_isa_probe_that_passed_loads_once_per_machine(tmp_path):
    """Two fresh processes pick inductor's vector ISA with the same cache directory: the
    first runs torch's probes (the patch only calls them), the second none, and picks the
    same ISA with the same flags."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    picks = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", PICK_ISA], capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        picks.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, second = picks
    assert first["probes"] > 0 and second["probes"] == 0, picks
    assert (second["isa"], second["flags"]) == (first["isa"], first["flags"])
    markers = list((tmp_path / "inductor" / torch_compat.VEC_ISA_PROBES_DIR).iterdir())
    assert 0 < len(markers) <= first["probes"]


class _Isa:
    def build_arch_flags(self) -> str:
        return "-mavx2 -mfma"


def test_a_failed_vec_isa_probe_is_not_remembered(tmp_path, monkeypatch):
    """A probe can fail for a passing reason (it timed out under load): it runs again next time."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    answers, calls = [False, True, False], []

    def probe(isa, code):
        calls.append(code)
        return answers[len(calls) - 1]

    check_build = torch_compat.VEC_ISA_PROBE_MEMO.make(probe)
    assert [check_build(_Isa(), "int f();") for _ in range(3)] == [False, True, True]
    assert len(calls) == 2  # the third answer came from the marker the second left
    assert check_build(_Isa(), "int g();") is False  # other code: probed, and answered False
    assert len(calls) == 3
