"""Where a training step's time goes: one more step under ``torch.profiler``, summarised.

An MFU number says how much of the device a step used, not what took the rest. This runs one
step after the timed ones with the profiler on and adds up, per op, the time its own work
took: the device time of the kernels it launched on a GPU, its self CPU time on a CPU. Ops fall
into a few categories by their names (``CATEGORIES``), so a report can say "attention 9 %,
GEMMs 61 %, the MoE permutation 12 %". On a GPU the step's wall time minus the device's busy
time is what the device sat idle: kernel launch gaps, host-side work, waits.

The categories go by aten op names, which stay stable across torch releases; everything not
matched is "other" and the top ops list names it.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

CATEGORIES: dict[str, tuple[str, ...]] = {
    "attention": (
        "scaled_dot_product",
        "flash_attention",
        "efficient_attention",
        "cudnn_attention",
        "aten::softmax",
        "aten::_softmax",
    ),
    "gemm": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "grouped_mm"),
    "communication": ("nccl", "c10d", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"),
    "optimizer": ("_foreach_", "multi_tensor", "adam"),
    "moe_routing_and_permutation": (
        "topk",
        "sort",
        "scatter",
        "gather",
        "index_select",
        "index_add",
        "index_put",
        "histc",
        "bincount",
        "cumsum",
        "nonzero",
        "masked_select",
        "repeat_interleave",
    ),
}
"""Category -> substrings of an op's name (first match wins, in this order; else "other").
Attention's softmax is the unfused attention's (``aten::_log_softmax`` of a loss does not match).
Optimizer: torch's foreach Adam and Megatron's local multi-tensor fallbacks. MoE routing and
permutation: the indexing ops of the router's top-k and the token dispatcher."""
TOP_OPS = 15
"""Ops named in the report: the step's slowest, and each category's slowest (which the step's
top list may leave out on a machine whose timings vary)."""


def category(op_name: str) -> str:
    name = op_name.lower()
    for label, patterns in CATEGORIES.items():
        if any(p.lower() in name for p in patterns):
            return label
    return "other"


def profile_step(step: Callable[[], object], cuda: bool) -> dict:
    """Run ``step`` once under the profiler; the summary (seconds, shares, top ops)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
    return summarize(prof.key_averages(), wall_s, cuda)


def summarize(averages, wall_s: float, cuda: bool) -> dict:
    """``averages``: the profiler's per-op totals. Only host-side ops are counted, each with
    its own (self) time, so no kernel is counted twice under an op and under its own name."""
    per_op = {}
    for event in averages:
        if getattr(event, "device_type", None) is not None and event.device_type.name != "CPU":
            continue  # a kernel's own row: its time is already its launching op's self device time
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if us > 0:
            per_op[event.key] = (us / 1e6, event.count)
    busy_s = sum(seconds for seconds, _ in per_op.values())
    by_category: dict[str, float] = {label: 0.0 for label in (*CATEGORIES, "other")}
    ops_of: dict[str, list[str]] = {label: [] for label in by_category}
    ranked = sorted(per_op.items(), key=lambda item: -item[1][0])
    for name, (seconds, _) in ranked:
        by_category[category(name)] += seconds
        ops_of[category(name)].append(name)
    top = ranked[:TOP_OPS]
    return {
        "time_source": "self device time of each op's kernels" if cuda else "self CPU time of each op",
        "step_wall_s": wall_s,
        "busy_s": busy_s,
        "idle_s": max(wall_s - busy_s, 0.0) if cuda else None,
        "categories": {
            label: {"seconds": s, "share_of_busy": s / busy_s if busy_s else 0.0, "ops": ops_of[label][:TOP_OPS]}
            for label, s in by_category.items()
        },
        "top_ops": [{"op": name, "seconds": s, "calls": n, "category": category(name)} for name, (s, n) in top],
    }


def describe(summary: dict) -> str:
    """One line for the bench's output: each category's share of the busy time."""
    shares = ", ".join(
        f"{label} {100 * c['share_of_busy']:.0f}%" for label, c in summary["categories"].items() if c["seconds"] > 0
    )
    idle = (
        f", idle {summary['idle_s']:.3f} s of {summary['step_wall_s']:.3f} s" if summary["idle_s"] is not None else ""
    )
    return f"profile: busy {summary['busy_s']:.3f} s ({shares}){idle}"
