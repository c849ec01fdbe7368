"""torchrun body: every family x layout, HF -> sharded Megatron -> HF.

Per case: build the Megatron actor in the layout, load the tiny HF checkpoint with
load_hf (each rank reads its slices), compare Megatron's logits with transformers' on the
same tokens, and stream the model back with iter_hf_tensors and iter_hf_buckets: every rank
must receive tensors bitwise equal to the input file's. "save" cases also write an HF directory with
save_hf and load it with transformers.AutoModelForCausalLM.
"""

import atexit
import os
import shutil
import sys
import tempfile
from functools import partial
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist

from megatron_rl.bridge import FUSED, PER_EXPERT, BridgeError, iter_hf_buckets, iter_hf_tensors, load_hf, save_hf
from megatron_rl.bridge.parity import hf_logits, make_tiny_hf, megatron_logits, read_config
from megatron_rl.models import build_model
from megatron_rl.models.hf_config import arch_from_hf
from megatron_rl.parallel import ParallelConfig, destroy, initialize
from megatron_rl_lab.testing.torchrun import run_cases

DENSE = ("llama", "qwen2", "qwen3")
MOE = ("qwen2_moe", "qwen3_moe", "mixtral")
TOKENS = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(7))

LAYOUTS = {
    4: {
        "tp1": dict(),
        "tp2": dict(tensor_model_parallel_size=2),
        "pp2": dict(pipeline_model_parallel_size=2),
        "ep2": dict(expert_model_parallel_size=2),
        "tp2_ep2_etp1": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1),
    },
    8: {
        "tp2_pp2": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
        "tp2_pp2_ep2": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2),
    },
}

_ROOT: list = []
_HF: dict = {}


def root() -> Path:
    """One temporary directory shared by all ranks (rank 0 creates it)."""
    if not _ROOT:
        path = [tempfile.mkdtemp(prefix="bridge-test-") if dist.get_rank() == 0 else None]
        if dist.get_rank() == 0:
            atexit.register(shutil.rmtree, path[0], True)
        dist.broadcast_object_list(path, src=0)
        _ROOT.append(Path(path[0]))
    return _ROOT[0]


def hf_model(family: str, style: str):
    """(dir, source tensors, transformers logits), built once per process."""
    if (family, style) not in _HF:
        from safetensors.torch import load_file

        path = root() / f"{family}-{style}"
        if dist.get_rank() == 0:
            make_tiny_hf(family, path, style=style, seed=(DENSE + MOE).index(family))
        dist.barrier()
        source = {}
        for file in sorted(path.glob("*.safetensors")):
            source.update(load_file(file))
        _HF[family, style] = (path, source, hf_logits(path, TOKENS))
    return _HF[family, style]


def all_ranks_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def case(family: str, layout: dict, style: str = PER_EXPERT, save: bool = False) -> dict:
    path, source, reference = hf_model(family, style)
    arch = arch_from_hf(path)
    parallel = ParallelConfig(**layout)
    ctx = initialize(parallel, seed=1, model=arch.shape())
    chunks = build_model("actor", arch, parallel)
    loaded_style = load_hf(chunks, path, arch)
    logits = megatron_logits(chunks, TOKENS, ctx.pg_collection.tp)
    diff = -1.0 if logits is None else float((logits[..., : arch.vocab_size] - reference).abs().max())
    exported = dict(iter_hf_tensors(chunks, arch, style=loaded_style))
    wrong = sorted(n for n in source if n not in exported or not torch.equal(exported[n], source[n]))
    extra = sorted(set(exported) - set(source))
    # The weight sync's bucketed stream: the same tensors, buckets of whole layers (tiny
    # buckets: one layer each; the views are reused, so compare before the next bucket).
    bucketed = set()
    for bucket in iter_hf_buckets(chunks, arch, 1, style=loaded_style):
        layers = {n.split(".")[2] for n, _ in bucket if n.startswith("model.layers.")}
        if len(layers) > 1:
            wrong.append(f"bucket with layers {sorted(layers)}")
        wrong += [f"bucketed {n}" for n, t in bucket if n not in source or not torch.equal(t, source[n])]
        bucketed.update(n for n, _ in bucket)
    extra += sorted(set(source) ^ bucketed)
    result = {
        "logit_diff": all_ranks_max(diff),
        "logit_scale": float(reference.abs().max()),
        "style": loaded_style,
        "roundtrip_mismatch": int(all_ranks_max(len(wrong) + len(extra))),
        "mismatched": (wrong + extra)[:5],
        "num_tensors": len(exported),
    }
    if save:
        out = root() / f"saved-{family}-{style}-{'_'.join(map(str, layout.values()))}"
        save_hf(chunks, arch, out, read_config(path), style=loaded_style)
        reloaded = hf_logits(out, TOKENS)  # transformers reads what save_hf wrote
        result["saved_logit_diff"] = float((reloaded - reference).abs().max())
        saved = {}
        from safetensors.torch import load_file

        for file in sorted(out.glob("*.safetensors")):
            saved.update(load_file(file))
        result["saved_equal"] = set(saved) == set(source) and all(torch.equal(saved[n], source[n]) for n in source)
    destroy()
    return result


def broken_copy(family: str, name: str, change) -> Path:
    """A copy of the family's checkpoint with ``change(tensors)`` applied (rank 0 writes)."""
    from safetensors.torch import save_file

    path, source, _ = hf_model(family, PER_EXPERT)
    out = root() / f"broken-{family}-{name}"
    if dist.get_rank() == 0:
        out.mkdir()
        tensors = dict(source)
        change(tensors)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        (out / "config.json").write_text((path / "config.json").read_text())
    dist.barrier()
    return out


def errors(family: str = "qwen2_moe") -> dict:
    """Each broken checkpoint fails on every rank with a message naming the problem."""
    expert = "model.layers.1.mlp.experts.3.up_proj.weight"
    broken = {
        "missing": lambda t: t.pop(expert),
        "unexpected": lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}),
        "shape": lambda t: t.update({expert: t[expert][:-1]}),
    }
    path = hf_model(family, PER_EXPERT)[0]
    arch = arch_from_hf(path)
    parallel = ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    initialize(parallel, seed=1, model=arch.shape())
    chunks = build_model("actor", arch, parallel)
    messages = {}
    for name, change in broken.items():
        try:
            load_hf(chunks, broken_copy(family, name, change), arch)
            messages[name] = None
        except BridgeError as e:
            messages[name] = str(e)
    destroy()
    return messages


def cases(world_size: int) -> dict:
    out = {"errors": errors} if world_size == 4 else {}
    layouts = LAYOUTS[world_size]
    for family in DENSE + MOE:
        names = [n for n in layouts if family in MOE or "ep" not in n]
        for name in names:
            save = name == names[-1]  # each family's last layout also writes and re-reads HF
            out[f"{family}-{name}"] = partial(case, family, layouts[name], save=save)
        if family in MOE:  # transformers-5 stacked experts in, the same layout out
            out[f"{family}-{names[-1]}-fused"] = partial(case, family, layouts[names[-1]], FUSED, save=True)
    return out


if __name__ == "__main__":
    run_cases(cases(int(sys.argv[1])))
