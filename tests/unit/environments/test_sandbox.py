"""SandboxConfig's validation and the built root's plan (what the code can see)."""

import dataclasses
import sys

import pytest

from megatron_rl.environments.sandbox import SandboxConfig, plan_layout


@pytest.mark.parametrize(
    "field, value",
    [
        ("timeout_s", 0),
        ("timeout_s", -1.0),
        ("timeout_s", 601),
        ("timeout_s", float("nan")),
        ("timeout_s", "5"),
        ("cpu_s", 0),
        ("cpu_s", 1.5),
        ("memory_mb", 63),
        ("max_processes", 0),
        ("max_processes", True),
        ("max_output_bytes", 10),
        ("workdir_mb", 0),
        ("allow_weaker_isolation", "yes"),
        ("python", "python3"),
    ],
)
def test_a_bad_field_is_refused_naming_it_and_the_allowed_range(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be .*, got "):
        dataclasses.replace(SandboxConfig(), **{field: value})


def test_the_defaults_are_valid_and_frozen():
    config = SandboxConfig()
    assert (config.timeout_s, config.python, config.allow_weaker_isolation) == (5.0, sys.executable, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.timeout_s = 1.0


def test_the_root_binds_the_system_and_the_interpreter_once():
    layout = plan_layout(sys.executable)
    assert "/usr" in layout.binds and "/dev/null" in layout.devices
    assert sys.prefix in layout.binds or any(sys.prefix.startswith(b + "/") for b in layout.binds)
    for bind in layout.binds:  # none nested in another
        assert not any(bind.startswith(other + "/") for other in layout.binds if other != bind), layout.binds
    assert "/" not in layout.binds and not {"/etc", "/home", "/root", "/tmp", "/work"} & set(layout.binds)


def test_an_interpreter_that_cannot_run_is_refused():
    with pytest.raises(ValueError, match="python /nonexistent/python cannot run"):
        plan_layout("/nonexistent/python")


def test_the_root_is_built_where_it_hides_no_bind(tmp_path, monkeypatch):
    """The root's tmpfs hides what lies beneath its mount point: a virtual environment under
    /tmp (a CI clone there) must be bound from elsewhere, so the next staging place is used."""
    from megatron_rl.environments import sandbox_init

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    monkeypatch.setattr(sandbox_init, "STAGING_DIRS", (str(first), str(tmp_path / "missing"), str(second)))
    spec = {"binds": [str(first / "venv"), "/usr"], "devices": ["/dev/null"]}
    assert sandbox_init._staging_dir(spec) == str(second)
    spec["binds"].append(str(second))
    with pytest.raises(sandbox_init.SetupError, match="no place to build the root"):
        sandbox_init._staging_dir(spec)
