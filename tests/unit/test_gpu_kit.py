"""The GPU check kit's CPU side, so it does not rot between the sessions that have a GPU:
its wheel list resolves for the CUDA machine's Python, the GPU tests collect and skip with
their reason here and pass in a dry run on the CPU, every part's command line is one the
bench accepts, and a bad part name is one line and exit 2."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KIT_PATH = ROOT / "tools" / "gpu_check.py"


def _kit():
    spec = importlib.util.spec_from_file_location("gpu_check", KIT_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


def test_the_wheel_list_resolves_for_cp312(tmp_path):
    """Needs the package index (CI and developer machines have it)."""
    kit = _kit()
    proc = subprocess.run(kit.pip_download_argv(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheels = sorted(p.name for p in tmp_path.glob("*.whl"))
    assert len(wheels) == 2, wheels
    assert wheels[0].startswith("megatron_core-0.16.1-cp312-cp312-manylinux"), wheels
    assert wheels[1].startswith("xxhash-4.1.0-cp312-cp312-manylinux"), wheels


def test_the_gpu_tests_collect_and_skip_with_their_reason_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the kit runs these tests for real")
    kit = _kit()
    (part,) = [p for p in kit.parts(tmp_path) if p.name == "tests"]  # the kit's own command
    proc = subprocess.run(
        part.argv, cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    summary = kit.junit_summary(tmp_path / "tests.xml")
    assert summary["counts"]["skipped"] >= 3 and summary["counts"]["skipped"] == len(summary["tests"]), summary
    assert all("needs a CUDA device" in t["message"] for t in summary["tests"]), summary["tests"]


@pytest.mark.slow
def test_the_gpu_tests_pass_in_a_dry_run_on_cpu():
    """Their CUDA launches run on the CPU (MEGATRON_RL_GPU_DRY_RUN=1): this proves nothing about
    CUDA, but a body broken by a change elsewhere fails here and not in a short GPU lease."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the kit runs these tests for real")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ, MEGATRON_RL_GPU_DRY_RUN="1"),
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


def test_every_bench_part_is_a_command_the_bench_accepts(tmp_path):
    from megatron_rl_lab.bench import checkpoint, cli, plan

    kit = _kit()
    bench_parts = [p for p in kit.parts(tmp_path) if cli.__name__ in p.argv]
    assert {p.name for p in bench_parts} == {
        "mfu-dense",
        "mfu-dense-compiled",
        "mfu-dense-unfused",
        "mfu-moe",
        "mfu-moe-fast",
        "mfu-moe-local",
        "mfu-moe-sequential",
        "checkpoint",
    }
    for part in bench_parts:
        args = cli.build_parser().parse_args(part.argv[part.argv.index(cli.__name__) + 1 :])
        if args.bench == "mfu":
            arch, settings, cases, json_path = plan.make_plan(args, 1)
            assert settings.dtype == "bf16" and settings.seq_length == 4096 and len(cases) == 1
        else:
            assert checkpoint.make_plan(checkpoint.options_from_args(args), 1).reshard_layout is None
            json_path = args.json
        assert json_path == part.json_path(tmp_path) == tmp_path / f"{part.name}.json"
    default = [p for p in kit.parts(tmp_path) if p.default]
    assert sum(p.timeout_s for p in default) <= 600, "a lent GPU machine runs one command <= 10 min"
    assert [p.name for p in default] == ["mfu-dense", "mfu-dense-compiled", "tests", "mfu-moe", "mfu-moe-fast"]


def test_every_part_starts_without_the_packages_a_bare_machine_lacks(tmp_path):
    """Each part's entry point (the bench's parser for every bench part, pytest's collection
    of the GPU tests) with vLLM, math_verify and the rest hidden, as on the lent machine."""
    kit = _kit()
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\n"
        f"ABSENT = {kit.ABSENT_ON_A_BARE_MACHINE!r}\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ABSENT:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (hidden: a bare GPU machine lacks it)')\n"
        "sys.meta_path.insert(0, Hide())\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hide), str(ROOT)]))
    bench = ("megatron_rl_lab.bench.cli",)
    commands = {p.argv[p.argv.index(bench[0]) + 1] for p in kit.parts(tmp_path) if bench[0] in p.argv}
    for command in sorted(commands):
        proc = subprocess.run(
            [sys.executable, "-m", *bench, command, "--help"], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, f"bench {command}: {proc.stderr[-2000:]}"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/gpu", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def test_an_unknown_part_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(KIT_PATH), "run", str(tmp_path), "--parts", "tests,bogus"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr == (
        "gpu_check: unknown part(s) bogus; allowed: mfu-dense, mfu-dense-compiled, tests, mfu-moe, mfu-moe-fast, "
        "mfu-moe-local, mfu-moe-sequential, mfu-dense-unfused, tests-fusions, checkpoint\n"
    )
    assert list(tmp_path.iterdir()) == []
