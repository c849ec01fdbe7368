"""Every script in tools/ starts and describes its arguments (`--help`, exit 0), so a tool
broken by a refactor of what it imports is found by the unit tests, not by a user."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = sorted(p.name for p in (ROOT / "tools").glob("*.py"))


def test_every_tool_is_listed():
    assert len(TOOLS) >= 10, TOOLS


@pytest.mark.parametrize("tool", TOOLS)
def test_tool_help(tool):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / tool), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
    assert "usage:" in proc.stdout.lower(), proc.stdout[:500]
