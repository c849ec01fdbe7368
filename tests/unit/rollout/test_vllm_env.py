"""Colocation hygiene: vLLM logs at rollout.log_level."""

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.rollout import vllm_env


def test_kv_cache_size_is_written_as_vllm_parses_it(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    vllm_env.prepare_environment(None, 1.0, None)
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_log_level_is_set_from_the_config_value(monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # an inherited value: the configured one wins
    vllm_env.prepare_environment(None, 1.0, None, load_config(None, ["rollout.log_level=error"]).rollout.log_level)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"
    assert load_config(None, []).rollout.log_level == "warning"
    vllm_env.prepare_environment(None, 1.0, None)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    with pytest.raises(ValueError, match=r"vLLM log level 'verbose'; allowed: \['debug', 'info', 'warning', 'error'\]"):
        vllm_env.set_log_level("verbose")


def test_a_bad_log_level_is_a_config_error():
    with pytest.raises(
        ConfigError,
        match=r"rollout.log_level='loud' is not allowed; choose one of "
        r"\['debug', 'error', 'info', 'warning'\]",
    ):
        load_config(None, ["rollout.log_level=loud"])
    with pytest.raises(ConfigError, match="rollout.log_level='WARNING' is not allowed"):
        load_config(None, ["rollout.log_level=WARNING"])


VLLM_LEVELS = textwrap.dedent("""
    import logging, sys
    from megatron_rl.rollout import vllm_env
    vllm_env.set_log_level(sys.argv[1])      # before vLLM is imported: through its environment
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging_if_needed
    configure_logging_if_needed(LoggingConfig())  # what vLLM's LLMEngine does when it starts
    vllm_logger = logging.getLogger("vllm")
    print(vllm_logger.getEffectiveLevel(), min(h.level for h in vllm_logger.handlers))
    vllm_env.set_log_level("error")          # after: its logger and handlers follow
    print(vllm_logger.getEffectiveLevel(), min(h.level for h in vllm_logger.handlers))
""")


def test_vllm_itself_logs_at_the_configured_level():
    repo = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", VLLM_LEVELS, "warning"], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [str(logging.WARNING)] * 2 + [str(logging.ERROR)] * 2
