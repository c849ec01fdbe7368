"""The Patch form shared by the CPU layer and the vLLM patches: what it replaces comes back."""

import sys
import types

import pytest

from megatron_rl.platform.patch import Patch


class _Base:
    def inherited(self):
        return "base"


class _Target(_Base):
    @staticmethod
    def name(x):
        return f"plain-{x}"


@pytest.fixture
def target_module(monkeypatch):
    module = types.ModuleType("mrl_patch_target")
    module.function = lambda: "original"
    module.Target = _Target
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_module_attribute_apply_and_revert(target_module):
    patch = Patch("p", target_module.__name__, "function", "function", lambda original: lambda: "patched " + original())
    patch.apply()
    patch.apply()  # idempotent: wraps once
    assert target_module.function() == "patched original"
    patch.revert()
    assert target_module.function() == "original"


def test_class_attribute_keeps_its_staticmethod(target_module):
    def make(original):
        return staticmethod(lambda x: "job-" + original.__func__(x))

    patch = Patch("p", target_module.__name__, "Target.name", "Target.name", make)
    patch.apply()
    assert _Target.name(1) == "job-plain-1" and _Target().name(2) == "job-plain-2"
    patch.revert()
    assert isinstance(vars(_Target)["name"], staticmethod) and _Target.name(3) == "plain-3"


def test_inherited_attribute_is_wrapped_and_then_removed(target_module):
    patch = Patch(
        "p",
        target_module.__name__,
        "Target.inherited",
        "Target.inherited",
        lambda original: lambda self: "sub of " + original(self),
    )
    patch.apply()
    assert _Target().inherited() == "sub of base"
    patch.revert()
    assert "inherited" not in vars(_Target) and _Target().inherited() == "base"


def test_scope_builds_the_replacement_from_the_callers_state(target_module):
    patch = Patch(
        "p",
        target_module.__name__,
        "function",
        "function",
        lambda original, calls: lambda: calls.append(original()) or len(calls),
    )
    calls: list = []
    with patch.scope(calls):
        assert target_module.function() == 1 and target_module.function() == 2
        with patch.scope([]):  # wraps the outer replacement; nested scopes restore in order
            assert target_module.function() == 1
        assert target_module.function() == 4
    assert target_module.function() == "original" and calls == ["original"] * 4
    with pytest.raises(RuntimeError), patch.scope(calls):
        raise RuntimeError("the block failed")
    assert target_module.function() == "original" and not patch.applied
