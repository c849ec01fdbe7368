"""The sandbox's tests need this machine's namespaces: on a developer machine that lacks one
they skip (saying which); in CI (``CI=true``) they fail, since CI must exercise them."""

import os

import pytest

from megatron_rl.environments.isolation import probe_isolation


@pytest.fixture(scope="session")
def isolation():
    """This machine's full isolation report; skip (fail in CI) where an isolation is missing."""
    report = probe_isolation()
    if report.missing:
        (pytest.fail if os.environ.get("CI", "").lower() == "true" else pytest.skip)(report.line())
    return report
