"""The cases of several test bodies in one torchrun launch (tests/distributed/conftest.py).

Usage: ``body_shared.py WORLD DIRECTORY BODY[,BODY...]``. Each body is a module of this
directory with ``cases(world_size)``; its cases are named ``BODY:CASE``. DIRECTORY is
the second argument the bodies read (body_checkpoint saves there)."""

import importlib.util
import sys
from pathlib import Path

from megatron_rl_lab.testing.torchrun import run_cases


def body_cases(body: str, world_size: int) -> dict:
    """``body``'s cases at ``world_size``, the module imported once under its own name (a
    body importing another, as body_model_layouts does body_schedules, shares it)."""
    module = sys.modules.get(body)
    if module is None:
        spec = importlib.util.spec_from_file_location(body, Path(__file__).with_name(f"{body}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[body] = module
        spec.loader.exec_module(module)
    return module.cases(world_size)


if __name__ == "__main__":
    world = int(sys.argv[1])
    run_cases(
        {f"{body}:{name}": case for body in sys.argv[3].split(",") for name, case in body_cases(body, world).items()}
    )
