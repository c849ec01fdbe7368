"""megatron_rl: RL for reasoning LLMs (dense and MoE) on Megatron-Core with vLLM rollouts."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def requirements(name: str) -> list[str]:
    lines = (HERE / "requirements" / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith(("#", "-r"))]


setup(
    name="megatron_rl",
    version="0.1.0",
    description="Reinforcement learning for reasoning LLMs on Megatron-Core with vLLM rollouts",
    long_description=(HERE / "README.md").read_text() if (HERE / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.11,<3.13",  # 3.12: the CUDA machines of tools/gpu_check.py
    packages=find_packages(include=["megatron_rl", "megatron_rl.*", "megatron_rl_lab", "megatron_rl_lab.*"]),
    package_data={"megatron_rl.monitor": ["weights/*.safetensors"]},
    install_requires=requirements("base.txt"),
    extras_require={
        "cpu": requirements("cpu.txt"),
        # CUDA clusters: vLLM's CUDA build and Transformer Engine (CP>1, fused kernels).
        "gpu": ["vllm", "transformer-engine[pytorch]", "nvidia-ml-py"],
        "loggers": ["wandb==0.31.0", "mlflow-skinny==3.17.2"],  # trainer.loggers beyond TensorBoard
        "test": requirements("test.txt"),
    },
    entry_points={
        "console_scripts": ["megatron-rl=megatron_rl.cli:entry"],
        # The lab's subcommands (megatron_rl.commands reads this group; the runtime never
        # imports megatron_rl_lab by name).
        "megatron_rl.commands": [
            "bench=megatron_rl_lab.commands:BENCH",
            "monitor.eval=megatron_rl_lab.commands:MONITOR_EVAL",
            "monitor.synth=megatron_rl_lab.commands:MONITOR_SYNTH",
            "monitor.train-synthetic=megatron_rl_lab.commands:MONITOR_TRAIN_SYNTHETIC",
        ],
    },
)
