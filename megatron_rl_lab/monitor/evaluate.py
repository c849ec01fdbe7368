"""Evaluation on synthetic traces: precision/recall/F1 per fault kind, false alarms per
machine-hour, detection delay and call time, for the detector and the baselines.

Protocol (`run_evaluation`): each method's threshold is tuned on one range of seeds and
reported on another; the denoiser is trained on fault-free traces of a third. Scoring
(the expensive part) runs once per trace and method; the threshold sweep reuses it.
Matching: an alert is a true positive if it names the faulty machine and is declared
after the fault started; every other alert is a false alarm. A fault counts as found
if any true positive names it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import numpy as np

from megatron_rl.monitor.denoise import Denoiser, DenoiserConfig, WindowMedian, train_denoiser
from megatron_rl.monitor.detect import Alert, DetectConfig, Scores, declare, score_grid
from megatron_rl.monitor.tuning import TUNING, Tuning
from megatron_rl.monitor.windows import Grid, normal_windows

from .baseline import mahalanobis_scores, zscore_scores
from .coupled import COUPLED_FAULT_KINDS, CoupledConfig, generate_coupled
from .synth import FAULT_KINDS, SynthConfig, SynthTrace, generate


@dataclass(frozen=True)
class EvalConfig:
    """Which synthetic traces to evaluate on."""

    kinds: tuple[str, ...] | None = None
    """Fault kinds to generate; None: all of the generator's kinds."""
    machines: tuple[int, ...] = (8, 32, 128)
    faulty_per_cell: int = 4
    """Faulty traces per (fault kind, machine count)."""
    fault_free_per_size: int = 8
    """Fault-free traces per machine count."""
    seed: int = 10_000
    duration_s: int = 900
    distractors: bool = False
    """Generate with `SynthConfig.distractors` (job-wide load changes, pipeline phases,
    multi-second sensor spikes)."""
    step_metrics: bool = False
    """Every trace also carries step and section times (`straggler` traces always do), so
    fault-free traces measure the false alarms they add."""
    step_period_s: tuple[float, float] = (6.0, 12.0)
    """`step_period_s` of every trace."""
    generator: str = "synth"
    """Which generator builds the traces: a key of GENERATORS."""

    def __post_init__(self) -> None:
        if self.generator not in GENERATORS:
            raise ValueError(f"generator: {self.generator!r}; allowed: {', '.join(GENERATORS)}")
        for n in self.machines[:1]:  # the generator's own config checks duration and step period now
            GENERATORS[self.generator].config(self, n, self.seed, None)
        if self.kinds is None:
            object.__setattr__(self, "kinds", GENERATORS[self.generator].kinds)

    def scenarios(self) -> list:
        make = GENERATORS[self.generator].config
        out = []
        for n in self.machines:
            for j in range(self.fault_free_per_size):
                out.append(make(self, n, self.seed + j, None))
            for kind in self.kinds:
                for j in range(self.faulty_per_cell):
                    out.append(make(self, n, self.seed + j, kind))
        return out

    def generate(self, config) -> SynthTrace:
        return GENERATORS[self.generator].generate(config)


def _synth_config(ec: EvalConfig, machines: int, seed: int, fault: str | None) -> SynthConfig:
    return SynthConfig(
        machines=machines,
        seed=seed,
        fault=fault,
        duration_s=ec.duration_s,
        distractors=ec.distractors,
        step_metrics=ec.step_metrics,
        step_period_s=ec.step_period_s,
    )


def _coupled_config(ec: EvalConfig, machines: int, seed: int, fault: str | None) -> CoupledConfig:
    """Coupled traces always carry their own distractors (they are part of its model), so
    `ec.distractors` does not apply."""
    return CoupledConfig(
        machines=machines,
        seed=seed,
        fault=fault,
        duration_s=ec.duration_s,
        step_metrics=ec.step_metrics,
        step_period_s=tuple(ec.step_period_s),
    )


@dataclass(frozen=True)
class Generator:
    """A trace generator as the evaluation sees it: its fault kinds, how an EvalConfig
    becomes one trace's config, and the function that builds the trace."""

    kinds: tuple[str, ...]
    config: Callable[[EvalConfig, int, int, str | None], object]
    generate: Callable[[object], SynthTrace]


GENERATORS = {
    "synth": Generator(FAULT_KINDS, _synth_config, generate),
    "coupled": Generator(COUPLED_FAULT_KINDS, _coupled_config, generate_coupled),
}
ALL_KINDS = tuple(dict.fromkeys(k for g in GENERATORS.values() for k in g.kinds))
"""Every generator's kinds, for tallies and report rows (kinds without faults are skipped)."""


@dataclass
class Method:
    """A detector under evaluation: an expensive scorer, declare settings, thresholds to try."""

    name: str
    score: Callable[[Grid], Scores]
    cfg: DetectConfig
    thresholds: tuple[float, ...]
    tuning: Tuning = TUNING
    """The detector's constants (megatron_rl.monitor.tuning), one of them changed to measure it."""


def methods(denoiser: Denoiser | None, cfg: DetectConfig = DetectConfig(), tuning: Tuning = TUNING) -> list[Method]:
    """The detector (LSTM-VAE, window-median and raw windows) and the two baselines."""
    minder = tuple(np.round(np.arange(2.0, 12.01, 0.5), 2))
    out = []
    if denoiser is not None:
        out.append(Method("minder (LSTM-VAE)", lambda g: score_grid(g, cfg, denoiser, tuning), cfg, minder, tuning))
    out += [
        Method("minder, window median", lambda g: score_grid(g, cfg, WindowMedian(), tuning), cfg, minder, tuning),
        Method("minder, no denoiser", lambda g: score_grid(g, cfg, None, tuning), cfg, minder, tuning),
        Method("z-score baseline", zscore_scores, cfg, tuple(np.arange(3.0, 20.01, 1.0)), tuning),
        Method(
            "Mahalanobis baseline", mahalanobis_scores, cfg, tuple(np.round(np.arange(1.0, 10.01, 0.25), 2)), tuning
        ),
    ]
    return out


@dataclass
class Outcome:
    """One trace: its labels and, per (method, threshold), the alerts declared."""

    config: SynthConfig | CoupledConfig
    labels: list
    alerts: dict[tuple[str, float], list[Alert]]


def run_all(
    ms: list[Method], ec: EvalConfig, thresholds: dict[str, tuple[float, ...]] | None = None, log=None
) -> list[Outcome]:
    """Generate every trace once, score it with every method, declare at each threshold
    (a method's own grid unless `thresholds` fixes it)."""
    out = []
    scen = ec.scenarios()
    for j, sc in enumerate(scen):
        st: SynthTrace = ec.generate(sc)
        alerts = {}
        for m in ms:
            scores = m.score(st.grid)
            for th in (thresholds or {}).get(m.name, m.thresholds):
                alerts[(m.name, float(th))] = declare(
                    scores, replace(m.cfg, threshold=float(th)), tuning=m.tuning
                ).alerts
        out.append(Outcome(sc, st.labels, alerts))
        if log and (j + 1) % 10 == 0:
            log(f"  {j + 1}/{len(scen)} traces")
    return out


@dataclass
class Tally:
    tp: int = 0
    fp: int = 0
    fn: int = 0
    delays: list[float] = field(default_factory=list)
    metric_right: int = 0

    def add(self, alerts: list[Alert], labels) -> None:
        found = set()
        for a in alerts:
            lab = next((lb for lb in labels if lb.machine == a.machine and a.declared_at >= lb.start), None)
            if lab is None or lab.machine in found:
                self.fp += 1
                continue
            found.add(lab.machine)
            self.tp += 1
            self.delays.append(a.declared_at - lab.start)
            self.metric_right += a.metric in lab.metrics
        self.fn += sum(lb.machine not in found for lb in labels)

    def prf(self) -> tuple[float, float, float]:
        p = self.tp / (self.tp + self.fp) if self.tp + self.fp else 1.0
        r = self.tp / (self.tp + self.fn) if self.tp + self.fn else 1.0
        return p, r, (2 * p * r / (p + r) if p + r else 0.0)


def tally(outcomes: list[Outcome], name: str, threshold: float) -> dict:
    """Per-kind tallies ("fault-free" holds the false alarms of fault-free traces) plus
    the machine-hours of fault-free traces under "machine_hours"."""
    out: dict = {k: Tally() for k in ("fault-free",) + ALL_KINDS}
    hours = 0.0
    for o in outcomes:
        out[o.config.fault or "fault-free"].add(o.alerts[(name, float(threshold))], o.labels)
        if o.config.fault is None:
            hours += o.config.machines * o.config.duration_s / 3600
    out["machine_hours"] = hours
    return out


def overall(t: dict) -> Tally:
    total = Tally()
    for v in t.values():
        if isinstance(v, Tally):
            total.tp, total.fp, total.fn = total.tp + v.tp, total.fp + v.fp, total.fn + v.fn
            total.delays += v.delays
            total.metric_right += v.metric_right
    return total


def tune(outcomes: list[Outcome], m: Method) -> tuple[float, float]:
    """(threshold, F1) with the best overall F1; ties go to fewer false alarms, then to the
    higher threshold (the more conservative one)."""
    best = (-1.0, 0, 0.0)
    for th in m.thresholds:
        total = overall(tally(outcomes, m.name, th))
        best = max(best, (round(total.prf()[2], 6), -total.fp, float(th)))
    return best[2], best[0]


def call_time(
    score: Callable[[Grid], Scores],
    cfg: DetectConfig,
    machines: int,
    repeats: int = 3,
    duration_s: int = 900,
    tuning: Tuning = TUNING,
) -> float:
    """Median seconds of one detection call (score + declare) on a 15-minute grid."""
    grid = generate(SynthConfig(machines=machines, seed=1, fault="gpu_drop", duration_s=duration_s)).grid
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        declare(score(grid), cfg, tuning=tuning)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def train_synthetic_denoiser(
    seed: int = 100, traces: int = 4, machines: int = 64, cfg: DenoiserConfig = DenoiserConfig(), log=None
) -> Denoiser:
    """Denoiser trained on fault-free synthetic traces (seeds disjoint from evaluation)."""
    wins: dict[str, list[np.ndarray]] = {}
    for j in range(traces):
        grid = generate(SynthConfig(machines=machines, seed=seed + j)).grid
        for k, w in normal_windows(grid, cfg.window).items():
            wins.setdefault(k, []).append(w)
    return train_denoiser({k: np.concatenate(v) for k, v in wins.items()}, cfg, log=log)


def report_rows(t: dict) -> list[dict]:
    """One row per fault kind plus the overall row, ready for a table or JSON."""
    rows = []
    for kind in ALL_KINDS + ("overall",):
        v = overall(t) if kind == "overall" else t[kind]
        if kind == "overall" or v.tp + v.fn:
            p, r, f = v.prf()
            d = np.array(v.delays) if v.delays else np.array([np.nan])
            rows.append(
                {
                    "kind": kind,
                    "precision": p,
                    "recall": r,
                    "f1": f,
                    "tp": v.tp,
                    "fp": v.fp,
                    "fn": v.fn,
                    "delay_median_s": float(np.median(d)),
                    "delay_p90_s": float(np.percentile(d, 90)),
                    "metric_right": v.metric_right / v.tp if v.tp else float("nan"),
                }
            )
    fa = t["fault-free"].fp
    hours = t["machine_hours"]
    rows.append(
        {
            "kind": "fault-free",
            "false_alarms": fa,
            "machine_hours": hours,
            "fa_per_machine_hour": fa / hours if hours else float("nan"),
            "fa_per_machine_day": 24 * fa / hours if hours else float("nan"),
        }
    )
    return rows


def format_table(results: dict[str, list[dict]]) -> str:
    """Markdown: methods side by side, per kind F1 and the headline numbers."""
    lines = [
        "| method | kind | precision | recall | F1 | found / faults | delay median / p90 (s) | right metric |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, rows in results.items():
        for r in rows:
            if "f1" in r:
                lines.append(
                    f"| {name} | {r['kind']} | {r['precision']:.3f} | {r['recall']:.3f} | "
                    f"{r['f1']:.3f} | {r['tp']} / {r['tp'] + r['fn']} | "
                    f"{r['delay_median_s']:.0f} / {r['delay_p90_s']:.0f} | "
                    f"{r['metric_right']:.2f} |"
                )
            else:
                lines.append(
                    f"| {name} | fault-free | {r['false_alarms']} false alarms in "
                    f"{r['machine_hours']:.0f} machine-hours = {r['fa_per_machine_day']:.4f} "
                    f"per machine-day | | | | | |"
                )
    return "\n".join(lines)


@dataclass(frozen=True)
class EvalPlan:
    """Tune on one seed range, report on another, time calls at several sizes."""

    tune: EvalConfig = EvalConfig(seed=1_000, machines=(8, 32, 128), faulty_per_cell=3, fault_free_per_size=4)
    test: EvalConfig = EvalConfig(seed=10_000, machines=(8, 32, 128, 512), faulty_per_cell=5, fault_free_per_size=8)
    timing_machines: tuple[int, ...] = (64, 256, 1024)
    only: tuple[str, ...] = ()
    """Evaluate only methods whose name contains one of these strings (empty: all)."""
    threshold: float | None = None
    """Fixed threshold for every method: no tuning run (for a quick held-out check)."""


def run_evaluation(
    plan: EvalPlan, denoiser: Denoiser | None, cfg: DetectConfig = DetectConfig(), log=print, tuning: Tuning = TUNING
) -> dict:
    """Tune each method's threshold, then report it on held-out seeds; JSON-ready dict."""
    ms = [m for m in methods(denoiser, cfg, tuning) if not plan.only or any(o in m.name for o in plan.only)]
    if plan.threshold is not None:
        chosen = {m.name: (plan.threshold, float("nan")) for m in ms}
    else:
        log(f"tuning thresholds on {len(plan.tune.scenarios())} traces (seeds from {plan.tune.seed})")
        tuned = run_all(ms, plan.tune, log=log)
        chosen = {m.name: tune(tuned, m) for m in ms}
    for name, (th, f1) in chosen.items():
        log(f"  {name}: threshold {th} (tuning F1 {f1:.3f})")
    log(f"held-out evaluation on {len(plan.test.scenarios())} traces (seeds from {plan.test.seed})")
    test = run_all(ms, plan.test, thresholds={n: (th,) for n, (th, _) in chosen.items()}, log=log)
    result = {
        "plan": {"tune": asdict(plan.tune), "test": asdict(plan.test)},
        "detect_config": {**asdict(cfg), **asdict(tuning)},  # the user's knobs and the constants
        "methods": {},
    }
    for m in ms:
        th, f1 = chosen[m.name]
        times = {n: call_time(m.score, replace(m.cfg, threshold=th), n, tuning=m.tuning) for n in plan.timing_machines}
        log(f"  {m.name}: call time " + ", ".join(f"{n} machines {t:.2f} s" for n, t in times.items()))
        by_size = {}
        for n in plan.test.machines:
            t = tally([o for o in test if o.config.machines == n], m.name, th)
            p, r, f = overall(t).prf()
            by_size[str(n)] = {"precision": p, "recall": r, "f1": f, "false_alarms": t["fault-free"].fp}
        result["methods"][m.name] = {
            "threshold": th,
            "tuning_f1": f1,
            "rows": report_rows(tally(test, m.name, th)),
            "by_machines": by_size,
            "call_time_s": {str(n): t for n, t in times.items()},
        }
    return result


def format_report(result: dict) -> str:
    """Markdown: the side-by-side table, F1 by cluster size, and the call times."""
    methods = result["methods"]
    first = next(iter(methods.values()))
    lines = [format_table({f"{name} (th {r['threshold']})": r["rows"] for name, r in methods.items()}), ""]
    lines.append("| method | " + " | ".join(f"F1 (false alarms) at {n} machines" for n in first["by_machines"]) + " |")
    lines.append("| --- |" + " --- |" * len(first["by_machines"]))
    for name, r in methods.items():
        lines.append(
            f"| {name} | "
            + " | ".join(f"{v['f1']:.3f} ({v['false_alarms']})" for v in r["by_machines"].values())
            + " |"
        )
    if first["call_time_s"]:
        lines += [
            "",
            "| method | " + " | ".join(f"call at {n} machines (s)" for n in first["call_time_s"]) + " |",
            "| --- |" + " --- |" * len(first["call_time_s"]),
        ]
        for name, r in methods.items():
            lines.append(f"| {name} | " + " | ".join(f"{t:.3f}" for t in r["call_time_s"].values()) + " |")
    return "\n".join(lines)
