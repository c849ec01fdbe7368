"""The isolation report and the refusal a run gives where an isolation is missing."""

import pytest

from megatron_rl.environments.isolation import IsolationError, IsolationReport, probe_isolation, require_isolation
from megatron_rl.environments.python_tool import PythonTool
from megatron_rl.environments.sandbox import SandboxConfig

NO_NETWORK = IsolationReport(False, True, True, True, "per-call uid", False, "/usr/bin/unshare", ("network: EPERM",))


def test_this_machine_has_every_isolation(isolation):
    assert isolation.missing == ()
    line = isolation.line()
    assert "\n" not in line and "network, mount, pid and ipc namespaces" in line and isolation.process_limit in line


def test_the_probe_says_what_is_missing_in_one_line():
    report = probe_isolation()
    assert "\n" not in report.line()
    assert ("MISSING" in report.line()) == bool(report.missing)
    assert NO_NETWORK.missing == ("network namespace",)
    assert NO_NETWORK.line() == "tool sandbox: MISSING network namespace (network: EPERM)"
    assert "--net" not in NO_NETWORK.unshare_flags() and "--pid" in NO_NETWORK.unshare_flags()


def test_a_missing_isolation_is_refused_unless_the_config_opts_out():
    with pytest.raises(IsolationError) as refused:
        require_isolation(SandboxConfig(), NO_NETWORK)
    message = str(refused.value)
    assert "\n" not in message and "network namespace" in message and "allow_weaker_isolation=true" in message
    require_isolation(SandboxConfig(allow_weaker_isolation=True), NO_NETWORK)
    with pytest.raises(IsolationError):
        PythonTool(SandboxConfig(), NO_NETWORK)
