"""Find the throwaway Slurm cluster of .ci/slurm_up.sh; without it `slurm` tests skip (saying
why) on a developer machine and fail in CI (``CI=true``), where the cluster must be there.

Only that cluster is used, never whatever Slurm a machine may belong to: the tests rely on
its short requeue delay (cred_expire=10), its 2-CPU node and its spare FUTURE node (partition
`debug`), and its namespace nodes mrl-n1..mrl-n3 (partition `nodes`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

DEFAULT_DIR = Path("/tmp/megatron-rl-slurm")


def _cluster() -> tuple[dict | None, str]:
    """(environment for Slurm commands, '') or (None, why not)."""
    conf = Path(os.environ.get("SLURM_CONF") or DEFAULT_DIR / "slurm.conf")
    if not conf.exists():
        return None, f"no Slurm cluster: {conf} absent (start one with .ci/slurm_up.sh --install, as root)"
    if "megatron-rl-ci" not in conf.read_text():
        return None, f"{conf} is not the test cluster of .ci/slurm_up.sh"
    if shutil.which("sbatch") is None:
        return None, "no Slurm cluster: sbatch not installed"
    env = dict(os.environ, SLURM_CONF=str(conf))
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return None, "no Slurm cluster: sinfo timed out"
    states = proc.stdout.split()
    if proc.returncode != 0 or not any(s in ("idle", "mixed", "allocated") for s in states):
        return (
            None,
            f"no Slurm cluster answering: sinfo exit {proc.returncode}, states {states} {proc.stderr.strip()[:200]}",
        )
    return env, ""


_ENV, _WHY = _cluster()


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def pytest_collection_modifyitems(config, items):
    if _ENV is not None:
        return
    missing = pytest.mark.usefixtures("_require_cluster") if in_ci() else pytest.mark.skip(reason=_WHY)
    for item in items:
        if "slurm" in item.keywords:
            item.add_marker(missing)


@pytest.fixture
def _require_cluster() -> None:
    """CI: a missing cluster is a failure, not a skip."""
    if _ENV is None:
        pytest.fail(f"CI=true and {_WHY}")


@pytest.fixture(scope="session")
def slurm_env(shared_caches) -> dict:
    """os.environ plus SLURM_CONF of the test cluster, read after the session's shared
    caches are set (tests/conftest.py): the cluster check runs at collection, before them."""
    if _ENV is None:
        (pytest.fail if in_ci() else pytest.skip)(_WHY)
    return dict(os.environ, SLURM_CONF=_ENV["SLURM_CONF"])
