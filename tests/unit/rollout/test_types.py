"""The rollout's plain values load without vLLM: the trainer's sources, the commands to
the rollout ranks and the layers above rollout use them on ranks that build no engine."""

import subprocess
import sys


def test_the_rollout_types_import_no_vllm():
    code = (
        "import sys\n"
        "from megatron_rl.rollout import EngineConfig, EvalSamples, Sample, Sampling\n"
        "from megatron_rl.rollout import types\n"
        "assert (EngineConfig, EvalSamples, Sample, Sampling) == "
        "(types.EngineConfig, types.EvalSamples, types.Sample, types.Sampling)\n"
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
