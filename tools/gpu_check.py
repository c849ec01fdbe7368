"""The GPU check kit: what to run when a bare CUDA machine is lent for a few minutes.

    python tools/gpu_check.py fetch                # a CPU machine with the package index: fill .whl/
    python3 tools/gpu_check.py run OUT_DIR         # the CUDA machine, from the repository root
    python3 tools/gpu_check.py run OUT_DIR --parts tests,mfu-dense

Such a machine has Python 3.12, torch with CUDA, transformers and pytest, and no package
index: Megatron-Core and xxhash travel as wheels (requirements/gpu-kit.txt, fetched for cp312
manylinux into .whl/, which git ignores). `run` installs the wheels into a temporary
target, puts it and the repository on PYTHONPATH, and runs each part in its own process
with its own time limit, so a part that fails or hangs costs only its own minutes. The
default parts (no --parts):

    mfu-dense        `megatron-rl bench mfu` of gpu-dense-1b, bf16, SDPA attention, with a
                     profile of one more step (time by op category)
    mfu-dense-compiled the same with the elementwise kernels compiled (--fusion compiled)
    tests            the gpu-marked tests (tests/gpu): schedules, the bridge's export, a
                     checkpoint round trip and the fast layers on CUDA, each against a reference
    mfu-moe          `megatron-rl bench mfu` of gpu-moe-2b, bf16, SDPA attention, the experts
                     as grouped GEMMs (what `auto` picks for bf16 on Hopper), with a profile
    mfu-moe-fast     the same with the local dispatcher and the compiled elementwise kernels

and by name: mfu-moe-local (grouped experts and the local dispatcher, uncompiled),
mfu-moe-sequential (Megatron's SequentialMLP experts), mfu-dense-unfused (Megatron's
unfused attention), tests-fusions (only tests/gpu/test_cuda_fusions.py), checkpoint
(`megatron-rl bench checkpoint` on CUDA: save stall against torch DCP).

It writes OUT_DIR/<part>.json for each part, OUT_DIR/summary.json (machine, versions, each
part's exit code and seconds) and OUT_DIR/gpu_check.log (everything the parts printed).
Only the standard library is imported here: the wheels are not installed yet when it starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
WHEEL_LIST = ROOT / "requirements" / "gpu-kit.txt"
WHEEL_DIR = ROOT / ".whl"
TARGET_PYTHON = "3.12"
# pip matches manylinux tags exactly, so name every glibc level a wheel may be tagged with.
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
ABSENT_ON_A_BARE_MACHINE = ("vllm", "math_verify", "reasoning_gym", "matplotlib", "tensorboard")
"""Runtime packages of requirements/base.txt and cpu.txt that a bare CUDA machine lacks and the
kit does not carry: nothing its parts import may need them (tests/unit/test_gpu_kit.py runs
the parts' entry points with these hidden). On 2026-12-04 a bench module that imported the
tasks at module level (and with them math_verify) cost a lent H200 its MFU parts."""
MFU_SHAPE = [
    "--dtype",
    "bf16",
    "--seq-length",
    "4096",
    "--global-batch-size",
    "16",
    "--micro-batch-size",
    "2",
    "--warmup",
    "2",
    "--steps",
    "5",
]


@dataclasses.dataclass(frozen=True)
class Part:
    """One check: a command run from the repository root, and its time limit. It writes
    OUT_DIR/<name>.json, or pytest's OUT_DIR/<name>.xml, which the kit turns into that JSON.
    Default parts run when no --parts are named; the others are baselines already measured
    or a subset, run by name."""

    name: str
    argv: tuple[str, ...]
    timeout_s: int
    default: bool = True

    def json_path(self, out: Path) -> Path:
        return out / f"{self.name}.json"


FAST_MOE = ("--experts", "grouped", "--dispatcher", "local", "--fusion", "compiled")
"""The MoE preset as fast as the kit builds it without TE: grouped experts, the sync-free local
dispatcher, the compiled elementwise kernels."""


def _pytest(out: Path, name: str, paths: Sequence[str], limit: int, default: bool) -> Part:
    argv = (sys.executable, "-m", "pytest", *paths, "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider")
    return Part(name, (*argv, "--junitxml", str(out / f"{name}.xml")), limit, default)


def parts(out: Path) -> list[Part]:
    """Every part, in the order they run (the headline numbers first, each baseline before the
    part it is compared with). The default parts' limits add up to 10 minutes, the longest
    command a lent machine runs. Measured on one H200: mfu-dense 50 s and mfu-moe 51 s with
    their profiles, the sequential MoE 44 s, checkpoint 63 s, the GPU test modules up to 246 s
    together, so the tests get the largest share; the compiled parts add inductor's compile."""
    # The lab's own entry, not `-m megatron_rl bench`: the kit runs the tree from PYTHONPATH,
    # where no installed entry point names the lab's subcommands.
    bench = (sys.executable, "-m", "megatron_rl_lab.bench.cli")

    def mfu(name: str, model: str, limit: int, *extra: str, default: bool = True) -> Part:
        json_path = str(out / f"{name}.json")
        return Part(name, (*bench, "mfu", "--model", model, *MFU_SHAPE, *extra, "--json", json_path), limit, default)

    checkpoint = (*bench, "checkpoint", "--model", "cpu-dense-85m", "--repeats", "3")
    return [
        mfu("mfu-dense", "gpu-dense-1b", 60, "--profile"),
        mfu("mfu-dense-compiled", "gpu-dense-1b", 110, "--fusion", "compiled", "--profile"),
        _pytest(out, "tests", ["tests/gpu"], 250, default=True),
        mfu("mfu-moe", "gpu-moe-2b", 70, "--experts", "grouped", "--profile"),
        mfu("mfu-moe-fast", "gpu-moe-2b", 110, *FAST_MOE, "--profile"),
        mfu("mfu-moe-local", "gpu-moe-2b", 70, "--experts", "grouped", "--dispatcher", "local", default=False),
        mfu("mfu-moe-sequential", "gpu-moe-2b", 60, "--experts", "sequential", default=False),
        mfu("mfu-dense-unfused", "gpu-dense-1b", 60, "--attention", "unfused", default=False),
        _pytest(out, "tests-fusions", ["tests/gpu/test_cuda_fusions.py"], 120, default=False),
        Part("checkpoint", (*checkpoint, "--json", str(out / "checkpoint.json")), 80, default=False),
    ]


def pip_download_argv(dest: Path, wheel_list: Path = WHEEL_LIST) -> list[str]:
    """pip's command that fetches the kit's wheels for the CUDA machine's Python."""
    argv = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        TARGET_PYTHON,
        "--implementation",
        "cp",
        "-d",
        str(dest),
        "-r",
        str(wheel_list),
    ]
    for tag in PLATFORMS:
        argv += ["--platform", tag]
    return argv


def fetch(dest: Path) -> int:
    dest.mkdir(exist_ok=True)
    return subprocess.run(pip_download_argv(dest), check=False).returncode


def install_wheels(wheels: Path, target: Path, log) -> None:
    """The carried wheels into ``target`` (no index, no dependencies: the machine has them)."""
    files = sorted(str(w) for w in wheels.glob("*.whl"))
    if not files:
        raise SystemExit(
            f"gpu_check: no wheels in {wheels}; run `python tools/gpu_check.py fetch` on a machine "
            "with the package index and carry the folder"
        )
    argv = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--target",
        str(target),
        *files,
    ]
    proc = subprocess.run(argv, capture_output=True, text=True)
    log.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"gpu_check: installing the wheels failed ({proc.returncode}); see the log")


def machine_facts(env: dict) -> dict:
    """The device, driver and library versions the numbers were taken with."""
    probe = (
        "import json, torch, megatron.core as m, transformers as t; "
        "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
        "'device': torch.cuda.get_device_name() if torch.cuda.is_available() else None, "
        "'megatron_core': m.__version__, 'transformers': t.__version__}))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT)
    facts = json.loads(proc.stdout) if proc.returncode == 0 else {"probe_error": proc.stderr[-2000:]}
    smi = shutil.which("nvidia-smi")
    if smi:
        query = "--query-gpu=name,memory.total,driver_version"
        facts["nvidia_smi"] = subprocess.run(
            [smi, query, "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
    facts.update(
        python=platform.python_version(), host=platform.node(), date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    )
    return facts


def junit_summary(xml_path: Path) -> dict:
    """pytest's JUnit XML as {counts, measured, tests: [{name, outcome, seconds, message}]}."""
    tests = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or "")[:2000]
        tests.append(
            {
                "name": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "seconds": float(case.get("time", 0)),
                "message": message,
            }
        )
    counts = {o: sum(t["outcome"] == o for t in tests) for o in ("passed", "failed", "error", "skipped")}
    # What the tests measured (record_testsuite_property: differences against the CPU, times).
    measured = {p.get("name"): p.get("value") for p in ET.parse(xml_path).getroot().iter("property")}
    return {"counts": counts, "measured": measured, "tests": tests}


def run_part(part: Part, out: Path, env: dict, log) -> dict:
    """One part in its own process group, killed at its time limit; its exit code and seconds."""
    log.write(f"\n==== {part.name}: {' '.join(part.argv)}\n")
    log.flush()
    start = time.time()
    proc = subprocess.Popen(part.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=part.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        code = "timeout"
    seconds = round(time.time() - start, 1)
    log.write(f"==== {part.name}: exit {code} after {seconds} s\n")
    log.flush()
    junit = out / f"{part.name}.xml"
    if junit.exists():
        part.json_path(out).write_text(json.dumps(junit_summary(junit), indent=1))
        junit.unlink()
    return {"exit": code, "seconds": seconds, "json": part.json_path(out).exists()}


def run(out: Path, names: Optional[Sequence[str]], wheels: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    chosen = [p for p in parts(out) if p.name in names] if names else [p for p in parts(out) if p.default]
    target = Path(tempfile.mkdtemp(prefix="mrl-gpu-kit-"))
    with open(out / "gpu_check.log", "w") as log:
        install_wheels(wheels, target, log)
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(ROOT), str(target)]),
            PYTHONUNBUFFERED="1",
            HF_HUB_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
        )
        summary = {"machine": machine_facts(env), "parts": {}}
        for part in chosen:
            summary["parts"][part.name] = run_part(part, out, env, log)
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
            print(f"gpu_check: {part.name}: {summary['parts'][part.name]}", flush=True)
    return 0 if all(p["exit"] == 0 for p in summary["parts"].values()) else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/gpu_check.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="download the kit's cp312 wheels (needs the package index)")
    f.add_argument("--dest", type=Path, default=WHEEL_DIR)
    r = sub.add_parser("run", help="run the checks on a CUDA machine; results under OUT_DIR")
    r.add_argument("out", type=Path, metavar="OUT_DIR")
    r.add_argument(
        "--parts",
        default="",
        help="comma-separated parts to run instead of the default ones ("
        + ", ".join(p.name for p in parts(Path(".")) if p.default)
        + "); all: "
        + ", ".join(p.name for p in parts(Path("."))),
    )
    r.add_argument("--wheels", type=Path, default=WHEEL_DIR)
    args = parser.parse_args(argv)
    if args.command == "fetch":
        return fetch(args.dest)
    names = [n for n in args.parts.split(",") if n]
    unknown = sorted(set(names) - {p.name for p in parts(args.out)})
    if unknown:
        parser.exit(
            2,
            f"gpu_check: unknown part(s) {', '.join(unknown)}; allowed: {', '.join(p.name for p in parts(args.out))}\n",
        )
    return run(args.out, names, args.wheels)


if __name__ == "__main__":
    sys.exit(main())
