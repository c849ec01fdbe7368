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
import threading
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl import checkpoint, platform
from megatron_rl.models import build_model
from megatron_rl.models.builder import BuildOptions
from megatron_rl.parallel import ParallelConfig, destroy, initialize
from megatron_rl.parallel.full_tensors import gather_full, params_as
from megatron_rl.testing.tiny import TINY_ARCHS
from megatron_rl.testing.torchrun import run_cases

GLOBAL_BATCH, SEQ, MBS = 8, 16, 2
ROOT = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("/tmp/ckpt-body")
TP2_EP2 = dict(tensor_model_parallel_size=2, expert_model_parallel_size=2)


class Run:
    """One model + Megatron DDP + distributed optimizer in one layout, trained on fixed data."""

    def __init__(self, kind, layout, seed=7, data="step", dtype="fp32"):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.arch, self.parallel, self.data = TINY_ARCHS[kind], ParallelConfig(**layout), data
        self.mbs = 1 if self.parallel.virtual_pipeline_model_parallel_size else MBS  # interleaving needs M >= PP
        self.ctx = initialize(self.parallel, seed=seed, model=self.arch.shape())
        chunks = build_model("actor", self.arch, self.parallel, BuildOptions(dtype=dtype))
        config = chunks[0].config
        with platform.megatron_scope():
            ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=False)
            self.chunks = [DistributedDataParallel(config, ddp, c) for c in chunks]
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True, clip_grad=1.0,
                                weight_decay=0.01, bf16=dtype == "bf16"),
                self.chunks,
            )
        config.finalize_model_grads_func = finalize_model_grads

    def batch(self, step):
        # "step": data fixed by the step number (any layout); "python_rng": drawn from python's
        # RNG, so only a resume that restores RNG state sees the same data.
        seed = step if self.data == "step" else random.getrandbits(62)
        g = torch.Generator().manual_seed(1000 + seed)
        tokens = torch.randint(0, self.arch.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=g)
        per_rank = GLOBAL_BATCH // self.parallel.dp(self.ctx.world_size)
        rows = slice(self.ctx.coords.dp * per_rank, (self.ctx.coords.dp + 1) * per_rank)
        tokens = tokens[rows]
        return [(tokens[i : i + self.mbs, :-1], tokens[i : i + self.mbs, 1:]) for i in range(0, per_rank, self.mbs)]

    def train(self, steps):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        losses = []
        for step in steps:
            micro = self.batch(step)
            with platform.megatron_scope():
                for c in self.chunks:
                    c.zero_grad_buffer()
                self.optimizer.zero_grad()
                out = get_forward_backward_func()(
                    forward_step_func=_forward_step,
                    data_iterator=[iter(micro) for _ in self.chunks] if len(self.chunks) > 1 else iter(micro),
                    model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
                    num_microbatches=len(micro), seq_length=SEQ, micro_batch_size=self.mbs, forward_only=False,
                )
                self.optimizer.step()
            local = sum(float(o["loss"]) for o in out) / len(out) if out else None
            everyone = [None] * self.ctx.world_size
            dist.all_gather_object(everyone, local)
            values = [v for v in everyone if v is not None]
            losses.append(sum(values) / len(values))
        return losses

    def full_params(self):
        return gather_full(self.chunks)

    def full_optimizer_state(self):
        """{'<state>.<name>': full tensor}, assembled without the checkpoint code: each DP
        rank writes its flat slice of a parameter's state into zeros, an all-reduce over the
        sub-optimizer's DP group completes it, gather_full assembles TP/PP/EP pieces."""
        from megatron_rl.checkpoint.optimizer_state import sub_optimizers

        per_key = {key: {} for key in ("param", "exp_avg", "exp_avg_sq")}
        for sub in sub_optimizers(self.optimizer):
            mine = {}
            for gbuf in sub.gbuf_ranges:
                for per_bucket in gbuf.values():
                    for bucket in per_bucket:
                        for param, ranges in bucket["param_map"].items():
                            mine[param] = ranges["param"]
            for buffer in sub.buffers:
                for param in buffer.params:  # same order on every DP rank
                    for key, full in per_key.items():
                        flat = torch.zeros(param.numel())
                        if param in mine:
                            r = mine[param]
                            flat[r.start : r.end] = sub._get_main_param_and_optimizer_states(param)[key].detach().view(-1)
                        dist.all_reduce(flat, group=sub.data_parallel_group)
                        full[param] = flat
        out = {}
        for key, full in per_key.items():
            with params_as(self.chunks, lambda p: full[p].view_as(p.data)):
                for name, tensor in gather_full(self.chunks).items():
                    out[f"{key}.{name}"] = tensor
        return out

    def step_count(self):
        from megatron_rl.checkpoint.optimizer_state import sub_optimizers

        return sorted({g["step"] for s in sub_optimizers(self.optimizer) for g in s.state_dict()["optimizer"]["param_groups"]})


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    out = model(tokens, positions, None, labels=labels)

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"loss": loss.detach().clone()}

    return out, loss_func


def _max_diff(a, b):
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


SAVED = {}


# MoE saves defer the snapshot to the background (the next optimizer step waits for it);
# the writer is held busy until that step has been called, so the copy provably starts
# after training went on.
SNAPSHOT = {"moe": "before_update", "dense": "at_save"}
HOLD_AFTER_UPDATE_S = 0.2


def _hold_writer_until_update(ckpt, optimizer):
    """Occupy ``ckpt``'s background writer until ``optimizer``'s next step() is called, then 0.2 s more."""
    from megatron_rl.checkpoint.optimizer_state import sub_optimizers

    called = threading.Event()
    hooks = [sub.optimizer.register_step_pre_hook(lambda *_: called.set()) for sub in sub_optimizers(optimizer)]
    ckpt._background().submit(lambda: (called.wait(120), time.sleep(HOLD_AFTER_UPDATE_S)))
    return hooks


def saved(kind, layout_name, layout, steps=2, more=2, dtype="fp32"):
    """Train ``steps``, save (async, then keep training while it writes), train ``more``.
    In bf16 the distributed optimizer's fp32 main params are separate from the bf16 weights
    and are saved (and resharded) as their own tensors."""
    key = (kind, layout_name, dtype)
    if key not in SAVED:
        root = ROOT / f"{kind}-{layout_name}" if dtype == "fp32" else ROOT / f"{kind}-{dtype}-{layout_name}"
        run = Run(kind, layout, dtype=dtype)
        run.train(range(1, steps + 1))
        params, optim = run.full_params(), run.full_optimizer_state()
        ckpt = checkpoint.Checkpointer()
        hooks = _hold_writer_until_update(ckpt, run.optimizer) if SNAPSHOT[kind] == "before_update" else []
        waited_before = ckpt.snapshot_wait_seconds()
        start = time.time()
        handle = ckpt.save(root, steps, model=run.chunks, optimizer=run.optimizer,
                           extra={"data_position": steps, "note": "async"}, async_save=True,
                           snapshot=SNAPSHOT[kind])
        blocking = time.time() - start
        continued = run.train(range(steps + 1, steps + more + 1))  # overlaps the background write
        handle.wait()
        for hook in hooks:
            hook.remove()
        SAVED[key] = dict(root=root, step=steps, params=params, optim=optim, continued=continued,
                          final=run.full_params(), blocking_s=blocking, steps=steps, more=more,
                          fp32_params_storage=_fp32_params_storage(root, steps), snapshot=SNAPSHOT[kind],
                          update_waited_s=ckpt.snapshot_wait_seconds() - waited_before)
        ckpt.close()
        if dist.get_rank() == 0:  # for loads by a launch of another world size (test data, not the store)
            torch.save({k: v for k, v in SAVED[key].items() if k != "root"}, root.with_name(root.name + ".reference.pt"))
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
    spans = lambda entry: {(c.file, c.byte_offset, c.nbytes) for c in entry.chunks}
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
    ref = saved(kind, save_name, save_layout, dtype=dtype) if save_layout is not None else saved_elsewhere(kind, save_name)
    run = Run(kind, load_layout, seed=99, dtype=dtype)  # a different init: everything must come from the file
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
    run = Run(kind, layout, data="python_rng", dtype=dtype)
    random.seed(5)
    run.train(range(1, n + 1))
    ckpt.save(root, n, model=run.chunks, optimizer=run.optimizer, extra={"step": n})
    straight = run.train(range(n + 1, n + m + 1))
    final = run.full_params()
    destroy()
    random.seed(123)  # scrambled: the checkpoint's RNG state must put it back
    resumed_run = Run(kind, layout, seed=99, data="python_rng", dtype=dtype)
    extra = ckpt.load(root, model=resumed_run.chunks, optimizer=resumed_run.optimizer)
    resumed = resumed_run.train(range(n + 1, n + m + 1))
    out = {"straight": straight, "resumed": resumed, "final_diff": _max_diff(resumed_run.full_params(), final), "extra": extra}
    destroy()
    return out


def retention_and_latest():
    """keep_last prunes only after a newer commit; latest names the newest step."""
    root = ROOT / "retention"
    run = Run("dense", {})
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
            "moe-tp2pp2ep2-to-ep4": partial(reshard, "moe", "tp2pp2ep2", save_layout, dict(expert_model_parallel_size=4)),
            "moe-tp2pp2ep2-to-pp2vpp2-ep2": partial(
                reshard, "moe", "tp2pp2ep2", save_layout,
                dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, expert_model_parallel_size=2),
            ),
        }
    return {
        "moe-tp2ep2-to-dp4": partial(reshard, "moe", "tp2ep2", TP2_EP2, {}),
        "moe-tp2ep2-to-ep4": partial(reshard, "moe", "tp2ep2", TP2_EP2, dict(expert_model_parallel_size=4)),
        "moe-tp2ep2-to-tp2ep2etp1": partial(
            reshard, "moe", "tp2ep2", TP2_EP2, dict(TP2_EP2, expert_tensor_parallel_size=1)
        ),
        "dense-pp2vpp2-to-tp2": partial(
            reshard, "dense", "pp2vpp2", dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
            dict(tensor_model_parallel_size=2),
        ),
        "dense-pp2vpp2-to-tp2pp2": partial(
            reshard, "dense", "pp2vpp2", dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
            dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
        ),
        "moe-bf16-tp2ep2-to-ep4": partial(reshard, "moe", "tp2ep2", TP2_EP2, dict(expert_model_parallel_size=4),
                                          dtype="bf16"),
        "exact-resume-moe-tp2ep2": partial(exact_resume, "moe", TP2_EP2),
        "exact-resume-moe-bf16-tp2ep2": partial(exact_resume, "moe", TP2_EP2, dtype="bf16"),
        "retention": retention_and_latest,
    }


if __name__ == "__main__":
    run_cases(cases(int(sys.argv[1])))
