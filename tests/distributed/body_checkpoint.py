"""torchrun body: save in one layout, load into others (model + distributed optimizer + RNG).

Expectations are independent of the store: full parameters come from ``gather_full`` and
full optimizer states from an all-reduce over each sub-optimizer's DP group (every DP rank
contributes its flat slice of each parameter), both taken in the saving layout before the
save; training continued after a resharded resume is compared with the saving run's own
continuation.

Usage: body_checkpoint.py WORLD_SIZE CKPT_ROOT
"""

import random
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl import checkpoint
from megatron_rl.parallel import destroy
from megatron_rl_lab.testing.torchrun import run_cases
from megatron_rl_lab.testing.training import TrainingRun, hold_writer_until_update

ROOT = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("/tmp/ckpt-body")
TP2_EP2 = dict(tensor_model_parallel_size=2, expert_model_parallel_size=2)


def _max_diff(a, b):
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


SAVED = {}


# MoE saves defer the snapshot to the background (the next optimizer step waits for it);
# the writer is held busy until that step has been called, so the copy provably starts
# after training went on.
SNAPSHOT = {"moe": "before_update", "dense": "at_save"}
HOLD_AFTER_UPDATE_S = 0.2


def saved(kind, layout_name, layout, steps=2, more=2, dtype="fp32"):
    """Train ``steps``, save (async, then keep training while it writes), train ``more``.
    In bf16 the distributed optimizer's fp32 main params are separate from the bf16 weights
    and are saved (and resharded) as their own tensors."""
    key = (kind, layout_name, dtype)
    if key not in SAVED:
        root = ROOT / f"{kind}-{layout_name}" if dtype == "fp32" else ROOT / f"{kind}-{dtype}-{layout_name}"
        run = TrainingRun(kind, layout, dtype=dtype)
        run.train(range(1, steps + 1))
        params, optim = run.full_params(), run.full_optimizer_state()
        ckpt = checkpoint.Checkpointer()
        deferred = SNAPSHOT[kind] == "before_update"
        hooks = hold_writer_until_update(ckpt, run.optimizer, HOLD_AFTER_UPDATE_S) if deferred else []
        waited_before = ckpt.snapshot_wait_seconds()
        start = time.time()
        handle = ckpt.save(
            root,
            steps,
            model=run.chunks,
            optimizer=run.optimizer,
            extra={"data_position": steps, "note": "async"},
            async_save=True,
            snapshot=SNAPSHOT[kind],
        )
        blocking = time.time() - start
        continued = run.train(range(steps + 1, steps + more + 1))  # overlaps the background write
        handle.wait()
        for hook in hooks:
            hook.remove()
        SAVED[key] = dict(
            root=root,
            step=steps,
            params=params,
            optim=optim,
            continued=continued,
            final=run.full_params(),
            blocking_s=blocking,
            steps=steps,
            more=more,
            fp32_params_storage=_fp32_params_storage(root, steps),
            snapshot=SNAPSHOT[kind],
            update_waited_s=ckpt.snapshot_wait_seconds() - waited_before,
        )
        ckpt.close()
        if dist.get_rank() == 0:  # for loads by a launch of another world size (test data, not the store)
            torch.save(
                {k: v for k, v in SAVED[key].items() if k != "root"}, root.with_name(root.name + ".reference.pt")
            )
        destroy()
    return SAVED[key]


def _reference_file(kind, layout_name) -> Path:
    return ROOT / f"{kind}-{layout_name}.reference.pt"


def saved_elsewhere(kind, layout_name):
    """The expectations written by the launch that saved ``kind-layout_name`` (another world size)."""
    ref = torch.load(_reference_file(kind, layout_name))
    return dict(ref, root=ROOT / f"{kind}-{layout_name}")


def _fp32_params_storage(root, step):
    """``aliased`` when the metadata of every optimizer.fp32_param.<name> points at <name>'s
    bytes (fp32 model: the main params are the parameters' own memory, stored once);
    ``separate`` when every one has its own fp32 bytes (bf16 model); else ``mixed``."""
    from megatron_rl.checkpoint import format as fmt

    tensors = fmt.read_metadata(root, step).tensors

    def spans(entry):
        return {(c.file, c.byte_offset, c.nbytes) for c in entry.chunks}

    fp32 = [n for n in tensors if n.startswith("optimizer.fp32_param.")]
    same = [spans(tensors[n]) == spans(tensors[n.removeprefix("optimizer.fp32_param.")]) for n in fp32]
    if fp32 and all(same):
        return "aliased"
    if fp32 and not any(same) and all(tensors[n].dtype == "float32" for n in fp32):
        return "separate"
    return "mixed"


def reshard(kind, save_name, save_layout, load_layout, dtype="fp32"):
    """Load into ``load_layout``: exact parameters and optimizer state, then same training.
    ``save_layout`` None: the checkpoint was saved by a launch of another world size."""
    ref = (
        saved(kind, save_name, save_layout, dtype=dtype)
        if save_layout is not None
        else saved_elsewhere(kind, save_name)
    )
    run = TrainingRun(kind, load_layout, seed=99, dtype=dtype)  # a different init: everything must come from the file
    extra = checkpoint.Checkpointer().load(ref["root"], model=run.chunks, optimizer=run.optimizer)
    params, optim = run.full_params(), run.full_optimizer_state()
    result = {
        "extra": extra,
        "param_diff": _max_diff(params, ref["params"]),
        "optim_diff": _max_diff(optim, ref["optim"]),
        "num_params": len(params),
        "num_optim": len(optim),
        "optim_steps": run.step_count(),
        "saved_step": ref["step"],
        "fp32_params_storage": ref["fp32_params_storage"],
        "dtype": dtype,
    }
    continued = run.train(range(ref["steps"] + 1, ref["steps"] + ref["more"] + 1))
    result["losses"], result["ref_losses"] = continued, ref["continued"]
    result["loss_diff"] = max(abs(a - b) for a, b in zip(continued, ref["continued"]))
    result["final_diff"] = _max_diff(run.full_params(), ref["final"])
    result["blocking_s"] = ref["blocking_s"]
    result["snapshot"], result["update_waited_s"] = ref["snapshot"], ref["update_waited_s"]
    destroy()
    return result


def exact_resume(kind, layout, n=2, m=2, dtype="fp32"):
    """N steps, save, M steps  ==  fresh model, load, M steps (data drawn from python's RNG)."""
    root = ROOT / f"resume-{kind}-{dtype}"
    ckpt = checkpoint.Checkpointer()
    run = TrainingRun(kind, layout, data="python_rng", dtype=dtype)
    random.seed(5)
    run.train(range(1, n + 1))
    ckpt.save(root, n, model=run.chunks, optimizer=run.optimizer, extra={"step": n})
    straight = run.train(range(n + 1, n + m + 1))
    final = run.full_params()
    destroy()
    random.seed(123)  # scrambled: the checkpoint's RNG state must put it back
    resumed_run = TrainingRun(kind, layout, seed=99, data="python_rng", dtype=dtype)
    extra = ckpt.load(root, model=resumed_run.chunks, optimizer=resumed_run.optimizer)
    resumed = resumed_run.train(range(n + 1, n + m + 1))
    out = {
        "straight": straight,
        "resumed": resumed,
        "final_diff": _max_diff(resumed_run.full_params(), final),
        "extra": extra,
    }
    destroy()
    return out


def retention_and_latest():
    """keep_last prunes only after a newer commit; latest names the newest step."""
    root = ROOT / "retention"
    run = TrainingRun("dense", {})
    seen = []
    with checkpoint.Checkpointer() as ckpt:
        for step in (1, 2, 3):
            ckpt.save(root, step, model=run.chunks, keep_last=2, async_save=step % 2 == 1).wait()
            seen.append(checkpoint.committed_steps(root))
    out = {"seen": seen, "latest": checkpoint.latest_step(root), "latest_file": (root / "latest").read_text().strip()}
    destroy()
    return out


def cases(world_size):
    if world_size == 1:  # loads what the world-4 launch saved under the same ROOT
        return {
            "moe-tp2ep2-to-world1": partial(reshard, "moe", "tp2ep2", None, {}),
            "dense-pp2vpp2-to-world1": partial(reshard, "dense", "pp2vpp2", None, {}),
        }
    if world_size == 8:
        save_layout = dict(TP2_EP2, pipeline_model_parallel_size=2)
        return {
            "moe-tp2pp2ep2-to-dp8": partial(reshard, "moe", "tp2pp2ep2", save_layout, {}),
            "moe-tp2pp2ep2-to-ep4": partial(
                reshard, "moe", "tp2pp2ep2", save_layout, dict(expert_model_parallel_size=4)
            ),
            "moe-tp2pp2ep2-to-pp2vpp2-ep2": partial(
                reshard,
                "moe",
                "tp2pp2ep2",
                save_layout,
                dict(
                    pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, expert_model_parallel_size=2
                ),
            ),
        }
    return {
        "moe-tp2ep2-to-dp4": partial(reshard, "moe", "tp2ep2", TP2_EP2, {}),
        "moe-tp2ep2-to-ep4": partial(reshard, "moe", "tp2ep2", TP2_EP2, dict(expert_model_parallel_size=4)),
        "moe-tp2ep2-to-tp2ep2etp1": partial(
            reshard, "moe", "tp2ep2", TP2_EP2, dict(TP2_EP2, expert_tensor_parallel_size=1)
        ),
        "dense-pp2vpp2-to-tp2": partial(
            reshard,
            "dense",
            "pp2vpp2",
            dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
            dict(tensor_model_parallel_size=2),
        ),
        # context parallelism shards no weight, but the distributed optimizer's state is split
        # over DP x CP: saved at CP2 (DP2 x CP2), loaded at TP2 (DP2), and the reverse
        "dense-cp2-to-tp2": partial(
            reshard, "dense", "cp2", dict(context_parallel_size=2), dict(tensor_model_parallel_size=2)
        ),
        "dense-pp2vpp2-to-cp2": partial(
            reshard,
            "dense",
            "pp2vpp2",
            dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
            dict(context_parallel_size=2),
        ),
        "dense-pp2vpp2-to-tp2pp2": partial(
            reshard,
            "dense",
            "pp2vpp2",
            dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
            dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
        ),
        "moe-bf16-tp2ep2-to-ep4": partial(
            reshard, "moe", "tp2ep2", TP2_EP2, dict(expert_model_parallel_size=4), dtype="bf16"
        ),
        "exact-resume-moe-tp2ep2": partial(exact_resume, "moe", TP2_EP2),
        "exact-resume-moe-bf16-tp2ep2": partial(exact_resume, "moe", TP2_EP2, dtype="bf16"),
        "retention": retention_and_latest,
    }


if __name__ == "__main__":
    run_cases(cases(int(sys.argv[1])))
