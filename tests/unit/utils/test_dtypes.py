"""The package's one dtype table: config names <-> vLLM / HF strings <-> torch dtypes."""

import subprocess
import sys

import pytest
import torch

from megatron_rl.utils import dtypes

# Written out here, independently of the module: (config name, vLLM / HF string, torch dtype).
EXPECTED = [
    ("fp32", "float32", torch.float32),
    ("bf16", "bfloat16", torch.bfloat16),
    ("fp16", "float16", torch.float16),
]


@pytest.mark.parametrize("short, long, torch_dtype", EXPECTED)
def test_every_spelling_maps_to_every_other(short, long, torch_dtype):
    for name in (short, long, torch_dtype):
        assert dtypes.short_name(name) == short
        assert dtypes.long_name(name) == long
        assert dtypes.to_torch(name) is torch_dtype
    assert dtypes.short_name(dtypes.long_name(short)) == short
    assert dtypes.long_name(dtypes.to_torch(long)) == long


def test_the_allowed_names():
    assert dtypes.SHORT_NAMES == tuple(s for s, _, _ in EXPECTED)
    assert dtypes.LONG_NAMES == tuple(long for _, long, _ in EXPECTED)


@pytest.mark.parametrize("bad", ["fp8", "float64", torch.float64, torch.int32, "FP32", ""])
def test_unsupported_names_list_the_valid_ones(bad):
    with pytest.raises(ValueError, match="choose one of fp32, bf16, fp16 .or float32, bfloat16, float16."):
        dtypes.to_torch(bad)


def test_config_checks_dtype_names_without_torch():
    code = (
        "import sys\n"
        "from megatron_rl.config.schema import ConfigError, ModelConfig\n"
        "ModelConfig(dtype='bf16')\n"
        "try:\n    ModelConfig(dtype='fp8')\nexcept ConfigError as e:\n    print(e)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "model.dtype='fp8' is not allowed; choose one of ['bf16', 'fp16', 'fp32']"
    assert out[1] == "False"
