"""Resuming or evaluating a LoRA run's checkpoint, before any model is built: its steps hold
the adapters only, so they load over a base from an HF directory, and only over the base
they were trained on (recognised by the digest of its weights, bridge.hf_files.weights_digest)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from megatron_rl.bridge.hf_files import weights_digest
from megatron_rl.checkpoint.format import read_metadata
from megatron_rl.config import ConfigError
from megatron_rl.config.schema import LoraConfig


def check_adapter_base(root: Path, step: Optional[int], lora: Optional[LoraConfig], base_dir: Path) -> None:
    """Before any model is built: a LoRA run's checkpoint (adapters only, the base left out)
    resumes on the base its adapters were trained on, recognised by its weights' digest
    (bridge.hf_files.weights_digest); a ConfigError (exit 2) names what is wrong otherwise."""
    if step is None:
        return
    saved = read_metadata(Path(root), step).extra.get("lora") or {}
    where = f"{root} step {step}"
    if saved.get("adapters_only") and lora is None:
        raise ConfigError(f"{where} holds LoRA adapters only (no base weights): resume it with its model.lora section")
    digest = saved.get("base_digest")
    if lora is None or not digest:
        return
    found = weights_digest(base_dir)
    if digest != found:
        raise ConfigError(
            f"{where} holds LoRA adapters of another base (weights digest {digest[:12]}); this run's base "
            f"{base_dir} has digest {found[:12]}: resume with the base they were trained on "
            "(model.hf_path), or use a new trainer.run_dir"
        )
