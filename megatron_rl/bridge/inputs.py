"""The converters' inputs and outputs, checked before any work.

A conversion builds a model, reads every tensor and writes gigabytes; a typo in a path
must not cost that, nor surface as a traceback from deep inside transformers, nor land
a new checkpoint on top of an old one. Each check raises :class:`ConvertInputError`
with one line that names the flag, what is wrong and what is allowed; the checks read
only directory listings and config.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from megatron_rl.bridge.hf_files import INDEX_FILE

HF_MODEL = "an HF model directory holds config.json and *.safetensors weights"


class ConvertInputError(ValueError):
    """A converter's input or output path is not what the conversion needs."""


def check_hf_model_dir(path: Path, flag: str = "--hf") -> dict:
    """``path`` is an HF model directory of a supported family; returns its config.json."""
    from megatron_rl.models.hf_config import FAMILIES

    path = Path(path)
    if not path.exists():
        raise ConvertInputError(f"{flag} {path} does not exist ({HF_MODEL})")
    if not path.is_dir():
        raise ConvertInputError(f"{flag} {path} is not a directory ({HF_MODEL})")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConvertInputError(f"{flag} {path} is not an HF model directory: no config.json ({HF_MODEL})")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise ConvertInputError(f"{flag} {config_file} is not readable JSON ({err})") from err
    family = config.get("model_type") if isinstance(config, dict) else None
    if family not in FAMILIES:
        raise ConvertInputError(f"{flag} {path}: model_type={family!r} is not supported; supported: {sorted(FAMILIES)}")
    if not (path / INDEX_FILE).is_file() and not any(path.glob("*.safetensors")):
        raise ConvertInputError(f"{flag} {path} has no *.safetensors weights ({HF_MODEL}; .bin weights are not read)")
    return config


def check_checkpoint(root: Path, step: Optional[int] = None, flag: str = "--ckpt") -> int:
    """The committed step of checkpoint ``root`` to read (``step``, or the newest)."""
    from megatron_rl.checkpoint import format as fmt

    try:
        return fmt.resolve_step(root, step)
    except fmt.CheckpointError as err:
        raise ConvertInputError(f"{flag} {err}") from err


def check_new_checkpoint_root(path: Path, flag: str = "--out") -> None:
    """``path`` may receive a new checkpoint: absent, or empty but for unfinished saves.

    A root that already holds a committed step (or anything else) is refused, so a
    conversion never mixes its step with another run's or replaces one.
    """
    from megatron_rl.checkpoint import format as fmt

    path = Path(path)
    if not path.exists():
        return
    if not path.is_dir():
        raise ConvertInputError(f"{flag} {path} is a file; give a new or empty directory for the checkpoint")
    steps = fmt.committed_steps(path)
    if steps:
        raise ConvertInputError(
            f"{flag} {path} already holds committed step(s) {steps}; give a new or empty directory for the checkpoint"
        )
    other = sorted(p.name for p in path.iterdir() if not p.name.startswith(".tmp_step_"))
    if other:
        raise ConvertInputError(
            f"{flag} {path} is not empty (holds {', '.join(other[:5])}); "
            "give a new or empty directory for the checkpoint"
        )


def check_new_hf_dir(path: Path, flag: str = "--out") -> None:
    """``path`` may receive a new HF directory: absent or empty (the export never merges)."""
    path = Path(path)
    if not path.exists():
        return
    if not path.is_dir():
        raise ConvertInputError(f"{flag} {path} is a file; give a new or empty directory for the HF model")
    entries = sorted(p.name for p in path.iterdir())
    if entries:
        raise ConvertInputError(
            f"{flag} {path} is not empty (holds {', '.join(entries[:5])}); "
            "give a new or empty directory for the HF model"
        )
