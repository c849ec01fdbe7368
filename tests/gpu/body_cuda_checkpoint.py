"""torchrun body: a checkpoint saved at world 1 on the platform's device with the deferred
snapshot, then loaded into the same layout and into others.

World 1 (the device launch): train the tiny MoE two steps, record its full parameters and
Adam state (gathered without the checkpoint code) in OUT_DIR/expected.pt, save with
``async_save=True, snapshot="before_update"`` and start the next training step as soon as
``save()`` returns. The design promises that an optimizer update waits for the deferred copy
(other in-place writes must call ``wait_snapshot()`` first, so the test changes the weights
through the optimizer); the background writer is held until that update is asked for, so the
copy provably runs after it was. A fresh model (another init) then loads the checkpoint in
the same layout. World 2 (a CPU launch on gloo): fresh models in TP2, PP2, EP2 and DP2 load the
same files.

Usage: body_cuda_checkpoint.py OUT_DIR (world 1 writes it, world 2 reads it)
"""

import os
import sys
import time
from functools import partial
from pathlib import Path

import torch

from megatron_rl import checkpoint, platform
from megatron_rl.parallel import destroy
from megatron_rl_lab.testing.torchrun import run_cases
from megatron_rl_lab.testing.training import TrainingRun, hold_writer_until_update

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/cuda-checkpoint")
ROOT = OUT / "ckpt"
EXPECTED = OUT / "expected.pt"
KIND, STEPS = "moe", 2
EXTRA = {"data_position": STEPS}
HOLD_AFTER_UPDATE_S = 0.2
LOAD_LAYOUTS = {
    1: {"same-layout": {}},
    2: {
        "tp2": dict(tensor_model_parallel_size=2),
        "pp2": dict(pipeline_model_parallel_size=2),
        "ep2": dict(expert_model_parallel_size=2),
        "dp2": {},  # the distributed optimizer's flat state split across two ranks
    },
}


def rng_states() -> dict:
    """The generators a checkpoint restores into the saving layout that the device changes."""
    states = {"torch_cpu": torch.get_rng_state()}
    if platform.current().is_cuda:
        states["torch_cuda"] = torch.cuda.get_rng_state()
    return states


def unequal(got: dict, want: dict) -> list[str]:
    """Names whose tensors are not bitwise equal (or that only one side has)."""
    return sorted(set(got) ^ set(want)) + sorted(n for n in set(got) & set(want) if not torch.equal(got[n], want[n]))


def host_buffers_pinned(ckpt) -> list[bool]:
    """Whether the host buffers of the last snapshot are pinned (they must be for a CUDA copy)."""
    return sorted({b.is_pinned() for hb in ckpt._buffers.values() for b in hb._buffers.values()})


def save() -> dict:
    run = TrainingRun(KIND, {})
    run.train(range(1, STEPS + 1))
    params = run.full_params()
    torch.save({"params": params, "optim": run.full_optimizer_state(), "rng": rng_states()}, EXPECTED)
    with checkpoint.Checkpointer() as ckpt:
        hooks = hold_writer_until_update(ckpt, run.optimizer, HOLD_AFTER_UPDATE_S)
        start = time.perf_counter()
        handle = ckpt.save(
            ROOT,
            STEPS,
            model=run.chunks,
            optimizer=run.optimizer,
            extra=EXTRA,
            async_save=True,
            snapshot="before_update",
        )
        returned_s = time.perf_counter() - start
        run.train([STEPS + 1])  # changes weights and Adam state in place: waits for the copy first
        handle.wait()
        pinned = host_buffers_pinned(ckpt)
        for hook in hooks:
            hook.remove()
    after = run.full_params()
    result = {
        "device": platform.current().device.type,
        "param_devices": sorted({p.device.type for c in run.chunks for p in c.parameters()}),
        "save_returned_s": returned_s,
        "update_waited_s": ckpt.snapshot_wait_seconds(),
        "host_buffers_pinned": pinned,
        "num_params": len(params),
        "num_changed_by_update": len(unequal(after, params)),
    }
    destroy()
    return result


def load(layout: dict) -> dict:
    """A fresh model in ``layout`` loads the checkpoint: every gathered tensor bitwise the saved one."""
    expected = torch.load(EXPECTED)
    run = TrainingRun(KIND, layout, seed=99)  # another init: every value must come from the file
    with checkpoint.Checkpointer() as ckpt:
        extra = ckpt.load(ROOT, model=run.chunks, optimizer=run.optimizer)
    rng = rng_states()
    params, optim = run.full_params(), run.full_optimizer_state()
    result = {
        "device": platform.current().device.type,
        "extra": extra,
        "param_mismatch": unequal(params, expected["params"])[:5],
        "optim_mismatch": unequal(optim, expected["optim"])[:5],
        "num_params": len(params),
        "num_optim": len(optim),
        "optim_steps": run.step_count(),
        "rng_restored": {k: torch.equal(rng[k], v) for k, v in expected["rng"].items() if k in rng},
    }
    destroy()
    return result


def cases(world_size: int) -> dict:
    out = {"save": save} if world_size == 1 else {}
    out.update({f"load-{name}": partial(load, layout) for name, layout in LOAD_LAYOUTS[world_size].items()})
    return out


if __name__ == "__main__":
    run_cases(cases(int(os.environ["WORLD_SIZE"])))
