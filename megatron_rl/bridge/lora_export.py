"""A LoRA checkpoint's adapters as an HF export: a PEFT adapter directory, or merged into the
base weights of a full HF directory.

The checkpoint holds each adapter's whole A [r, in] and B [out, r] under the canonical name of
its linear plus ``_lora`` (models.lora), and ``extra["lora"]`` (rank, alpha, dropout). Megatron
fuses linears HF keeps apart (QKV into one, gate and up into FC1), in its own row order; the
bridge's pieces say which rows of the fused weight go to which HF tensor. The same rows of B
go to that HF module's ``lora_B``, and every module cut from one fused linear shares its A: an
HF q, k and v with the same A and their rows of B compute exactly the fused adapter. Row-
parallel linears (the attention output, FC2) are one HF module each, A and B unchanged.
Adapters on MoE experts export merged only (transformers keeps a MoE layer's experts in
fused parameters, not in modules PEFT can adapt).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch

from megatron_rl.bridge.families import PER_EXPERT, rules_for
from megatron_rl.bridge.mapping import BridgeError, TensorMap, expand
from megatron_rl.models.adapter_names import ADAPTER_SUFFIX, TARGET_LINEARS, merged_weight
from megatron_rl.models.hf_config import ModelArch

PEFT_PREFIX = "base_model.model."


def base_weight(adapter_tensor: str) -> str:
    """``...linear_qkv_lora.a`` -> ``...linear_qkv.weight``."""
    owner, _, _ = adapter_tensor.rpartition(".")
    return f"{owner.removesuffix(ADAPTER_SUFFIX)}.weight"


def adapter_pairs(names) -> dict[str, tuple[str, str]]:
    """{base weight name: (its A's name, its B's name)} of the adapter tensors among ``names``."""
    pairs = {}
    for name in names:
        if name.endswith(f"{ADAPTER_SUFFIX}.a"):
            pairs[base_weight(name)] = (name, name[:-1] + "b")
    return pairs


def linear_map(arch: ModelArch) -> TensorMap:
    """``arch``'s Megatron <-> HF tensor map as far as its linears go: what cuts adapters into
    PEFT modules needs (the vocabulary padding, which only shapes the embedding, is left out)."""
    return expand(rules_for(arch.family, PER_EXPERT), arch, arch.vocab_size)


def hf_modules(arch: ModelArch, targets) -> tuple[str, ...]:
    """The last names of the HF modules (``q_proj``, ``down_proj``, ...) that adapters on the
    LoRA ``targets`` (adapter_names.TARGET_LINEARS) become in a PEFT adapter (and in vLLM's
    LoRA slot); experts have none."""
    linears = [f".{TARGET_LINEARS[t]}.weight" for t in targets if t != "experts"]
    names = set()
    for weight, pieces in linear_map(arch).pieces_of_megatron.items():
        if any(weight.endswith(linear) for linear in linears):
            names |= {piece.hf.removesuffix(".weight").rsplit(".", 1)[-1] for piece in pieces}
    return tuple(sorted(names))


def peft_tensors(pairs: dict, tmap: TensorMap, read: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """{PEFT key: tensor} of every adapter; ``read`` gives a full canonical tensor."""
    out = {}
    for weight, (a_name, b_name) in sorted(pairs.items()):
        if ".experts." in weight:
            raise BridgeError(f"{weight}: LoRA on MoE experts exports merged only (convert with --merge)")
        a, b = read(a_name), read(b_name)
        by_module = defaultdict(list)
        for piece in tmap.pieces_of_megatron[weight]:
            if piece.hf_lead:
                raise BridgeError(f"{weight}: its HF tensor {piece.hf} is fused; export merged (--merge)")
            by_module[piece.hf].append(piece)
        for hf, pieces in by_module.items():
            rows = tmap.hf_shapes[hf][0]
            lora_b = torch.zeros(rows, b.shape[1], dtype=b.dtype)
            for piece in pieces:
                lora_b[slice(*piece.hf_rows)] = b[piece.rows[0] : piece.rows[1]]
            if sum(p.hf_rows[1] - p.hf_rows[0] for p in pieces) != rows:
                raise BridgeError(f"{hf}: only part of its rows come from {weight}; export merged (--merge)")
            module = hf.removesuffix(".weight")
            out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.clone()
            out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = lora_b
    return out


def merged_hf_weights(tensors: dict, scaling: float) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """{HF weight name: its merge} of a PEFT adapter's ``tensors``: the function that folds the
    module's ``B A`` into that base weight (adapter_names.merged_weight, one formula)."""
    merges = {}
    for key in tensors:
        if key.endswith(".lora_A.weight"):
            module = key[len(PEFT_PREFIX) : -len(".lora_A.weight")]
            a, b = tensors[key], tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"]
            merges[f"{module}.weight"] = lambda w, a=a, b=b: merged_weight(w, a, b, scaling)
    return merges


def adapter_config(lora: dict, tensors: dict, base_model: str) -> dict:
    """PEFT's adapter_config.json for these tensors (target modules by their last name)."""
    modules = sorted({k[len(PEFT_PREFIX) :].rsplit(".", 2)[0].rsplit(".", 1)[-1] for k in tensors})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(lora["rank"]),
        "lora_alpha": float(lora["alpha"]),
        "lora_dropout": float(lora.get("dropout", 0.0)),
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "base_model_name_or_path": base_model,
    }


def write_peft_files(directory: Path, tensors: dict, config: dict, dtype=None) -> Path:
    """``adapter_config.json`` and ``adapter_model.safetensors`` written into ``directory``
    (over what it holds); ``directory``."""
    from safetensors.torch import save_file

    save_file(
        {k: (v.to(dtype) if dtype else v).contiguous() for k, v in tensors.items()},
        directory / "adapter_model.safetensors",
    )
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def write_peft_adapter(out_dir: str | os.PathLike, tensors: dict, config: dict, dtype=None) -> Path:
    """A PEFT adapter directory, new, written beside and renamed (never half-written)."""
    out = Path(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write_peft_files(tmp, tensors, config, dtype)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
