"""RL schedules and losses on CUDA equal the same body on the CPU, within the rounding of the
dtype: per-token logprobs and entropy of the actor, the critic's values, the metrics of one
DAPO actor update and one value-clipped critic update (train_step with Megatron's distributed
Adam), and the full gradients they stepped with; for the tiny dense and MoE models, padded and
packed (THD) rows, fp32 and bf16 (body_schedules_cuda.py: same weights, batch and routes on both).

Tolerances. Both runs compute the same expressions; they differ in the order and blocking of
sums (cuBLAS against the CPU's GEMMs, SDPA kernels, reductions) and, in bf16, in where results
are rounded. Each tolerance is an estimate of that difference, checked against one H200 run of
the dense cases (the MoE cases' CPU reference had crashed there: see tests/gpu/conftest.py):

fp32 (TF32 off in the body): a sum of K products carries a relative error of about sqrt(K)·2^-24
per order of summation; K ≤ 256 here gives ~1e-6 per GEMM, ~1e-5 after four layers of a dozen
ops with norms and softmaxes in between. Logprobs and entropies are ~4 nats, values ~1: 1e-4 is
that bound with a factor of ~3 to spare, and 1e-4 of the gradient's norm likewise. Measured on
the H200: logprobs 3.3e-6, entropy 2.2e-6, values 1.8e-6, gradients 1.3e-6 of their norm.

bf16: every op rounds its output to an 8-bit mantissa (relative 2^-8 ≈ 0.004 per rounding, half
that on average), and the devices round at different places (cuBLAS may reduce in bf16, the CPU
accumulates in fp32). About ten roundings per layer over four layers compound to ~2-3% relative
on the logits, whose spread is a few nats: 0.1 nats on logprobs and entropy; values (up to ~3)
take that 2-3% and their own output rounding (one bf16 ulp is 0.016 between 2 and 4): 0.1;
gradients 5e-2 of their norm. A yardstick that needs no GPU: bf16 against fp32 on the CPU (same
weights, rounded once to bf16 in both bf16 runs) differs by 0.099 in logprobs, 0.041 in values
and 2.7% in gradients. Measured CUDA against CPU on the H200 (dense): logprobs 0.024, entropy
0.028, values 0.031, gradients 1.4-1.8%. A real defect (a mask, a temperature, a packed
boundary, a gradient scale) moves these by O(1), far beyond both sets of tolerances.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from tests.gpu.conftest import case_result, expected_device, launch_on

BODY = Path(__file__).with_name("body_schedules_cuda.py")
CASES = [
    f"{kind}-{rows}-{dtype}" for kind in ("dense", "moe") for rows in ("padded", "packed") for dtype in ("fp32", "bf16")
]
FRACTION_METRICS = {"actor/clipfrac", "actor/dual_clipfrac", "critic/value_clipfrac"}
"""Counts of tokens over the same token count: no clip decision sits within rounding of its
boundary (the body's offsets), so these are equal, not close."""
COMPARED_METRICS = {
    "actor": ("loss", "pg_loss", "approx_kl", "ratio_mean", "ratio_max", "entropy", "grad_norm"),
    "critic": ("value_loss", "values_mean", "grad_norm"),
}

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    logp: float  # max |Δ| over predicted positions (nats)
    entropy: float  # max |Δ| over predicted positions (nats)
    values: float  # max |Δ| over each row's real positions
    grads: float  # ‖g_cuda − g_cpu‖ / ‖g_cpu‖ over all parameters
    metrics: float  # |Δ| / max(|cpu|, 1) of each compared update metric


TOLERANCES = {  # the module docstring derives them
    "fp32": Tolerance(logp=1e-4, entropy=1e-4, values=1e-4, grads=1e-4, metrics=1e-4),
    "bf16": Tolerance(logp=0.1, entropy=0.1, values=0.1, grads=5e-2, metrics=3e-2),
}


def grad_deviation(grads: dict, ref: dict) -> dict:
    """Relative norm of the difference over all parameters, and the tensor that deviates most."""
    assert set(grads) == set(ref), set(grads) ^ set(ref)
    diff = {k: float(torch.linalg.vector_norm((grads[k] - ref[k]).double())) for k in ref}
    norm = float(torch.sqrt(sum(g.double().square().sum() for g in ref.values())))
    worst = max(diff, key=lambda k: diff[k] / max(float(torch.linalg.vector_norm(ref[k].double())), 1e-12))
    return {
        "relative": math.sqrt(sum(d * d for d in diff.values())) / norm,
        "norm": norm,
        "worst_tensor": worst,
        "without_grad": sorted(k for k, g in ref.items() if not g.abs().max() > 0),
    }


def tensor_deviations(saved: dict, ref: dict) -> dict:
    """How far one case's saved tensors are from the reference's (both as the body saves them)."""
    assert torch.equal(saved["predicted"], ref["predicted"]) and torch.equal(saved["real"], ref["real"])
    on = lambda name, where: float((saved[name] - ref[name]).abs()[ref[where]].max())  # noqa: E731
    return {
        "logp": on("logp", "predicted"),
        "entropy": on("entropy", "predicted"),
        "values": on("values", "real"),
        "actor_grads": grad_deviation(saved["actor_grads"], ref["actor_grads"]),
        "critic_grads": grad_deviation(saved["critic_grads"], ref["critic_grads"]),
    }


def metric_deviations(result: dict, ref: dict) -> dict:
    """|Δ| / max(|ref|, 1) of each continuous update metric (relative above 1, absolute below: they
    are means of O(1) per-token terms, and a mean that cancels to ~0.1 has no relative scale of
    its own); |Δ| of each token fraction."""
    out = {}
    for role, names in COMPARED_METRICS.items():
        for name in names:
            key = f"{role}/{name}"
            out[key] = abs(result[role][key] - ref[role][key]) / max(abs(ref[role][key]), 1.0)
    for key in FRACTION_METRICS:
        role = key.split("/")[0]
        out[key] = abs(result[role][key] - ref[role][key])
    return out


def stepped_with_saved_grads(result: dict, saved: dict) -> dict:
    """Per role, |reported grad norm − ‖saved gradient‖| / ‖saved gradient‖: the saved gradient is
    the one train_step stepped with."""
    out = {}
    for role in ("actor", "critic"):
        norm = float(torch.sqrt(sum(g.double().square().sum() for g in saved[f"{role}_grads"].values())))
        out[role] = abs(result[role][f"{role}/grad_norm"] - norm) / norm
    return out


def deviations(result: dict, saved: dict, ref_result: dict, ref_saved: dict) -> dict:
    """Everything a case compares, one JSON-able report (the failure messages quote it)."""
    return {
        "tensors": tensor_deviations(saved, ref_saved),
        "metrics": metric_deviations(result, ref_result),
        "grad_norm_self_check": {
            "test": stepped_with_saved_grads(result, saved),
            "reference": stepped_with_saved_grads(ref_result, ref_saved),
        },
    }


def problems(report: dict, result: dict, tol: Tolerance) -> list[str]:
    """Every deviation of a case (``deviations``) beyond ``tol``, and every sign that the
    comparison says little (no update, a gradient too small); empty when the case passes."""
    t, found = report["tensors"], []
    for name in ("logp", "entropy", "values"):
        if not t[name] <= getattr(tol, name):
            found.append(f"{name}: {t[name]:.3g} > {getattr(tol, name)}")
    for role in ("actor", "critic"):
        g, r = t[f"{role}_grads"], result[role]
        if g["without_grad"] or not g["norm"] > 1e-2:
            found.append(f"{role}: reference gradient too small to compare")
        if not g["relative"] <= tol.grads:
            found.append(f"{role} gradient: {g['relative']:.3g} > {tol.grads} (worst: {g['worst_tensor']})")
        if r[f"{role}/update_skipped"] != 0.0 or not r["weights_moved"] > 0:
            found.append(f"{role}: the update did not move the weights")
    for key, dev in report["metrics"].items():
        limit = 1e-6 if key in FRACTION_METRICS else tol.metrics
        if not dev <= limit:
            found.append(f"{key}: {dev:.3g} > {limit}")
    for side, per_role in report["grad_norm_self_check"].items():
        if not max(per_role.values()) <= 1e-5:
            found.append(f"{side}: reported grad norm is not the saved gradient's: {per_role}")
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """{device: (case results, directory of saved tensors)}: one launch per device."""
    out = tmp_path_factory.mktemp("schedules-cuda")
    return {device: (launch_on(BODY, device, out, timeout_s=300), out / device) for device in ("cuda", "cpu")}


@pytest.mark.parametrize("case", CASES)
def test_cuda_matches_cpu(runs, case, record_testsuite_property):
    (cuda, cuda_dir), (cpu, cpu_dir) = runs["cuda"], runs["cpu"]
    result, ref = case_result(cuda, case), case_result(cpu, case)
    assert result["device"].startswith(expected_device("cuda")) and ref["device"] == "cpu", (result, ref)
    report = deviations(result, torch.load(cuda_dir / f"{case}.pt"), ref, torch.load(cpu_dir / f"{case}.pt"))
    record_testsuite_property(f"deviations[{case}]", json.dumps(report))  # into the kit's tests.json
    found = problems(report, result, TOLERANCES[case.rsplit("-", 1)[1]])
    assert not found, "\n".join([*found, json.dumps(report, indent=1)])
