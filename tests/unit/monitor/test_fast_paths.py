"""Faster code paths give the same numbers as the code they replaced (bit for bit where
the order of floating-point operations is kept; the same declarations everywhere)."""

import numpy as np
import pytest

from megatron_rl.monitor.denoise import Denoiser, default_model_dir
from megatron_rl.monitor.detect import DetectConfig, declare, denoised_windows, score_grid
from megatron_rl.monitor.peers import trailing_mean
from megatron_rl.monitor.tuning import Tuning
from megatron_rl.monitor.windows import cut_windows, window_maxima, window_means
from megatron_rl_lab.monitor.synth import SynthConfig, generate


def gather_trailing_mean(x, span):
    """The previous implementation: a gather of each window's start."""
    ok = ~np.isnan(x)
    c = np.cumsum(np.where(ok, x, 0.0), -1, dtype=np.float64)
    n = np.cumsum(ok, -1)
    pad = lambda a: np.concatenate([np.zeros_like(a[..., :1]), a], -1)  # noqa: E731
    c, n = pad(c), pad(n)
    lo = np.maximum(np.arange(x.shape[-1]) + 1 - span, 0)
    total, count = c[..., 1:] - c[..., lo], n[..., 1:] - n[..., lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / count, np.nan).astype(np.float32)


def test_trailing_mean_equals_the_gather_based_one():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 50)).astype(np.float32)
    x[rng.random(x.shape) < 0.2] = np.nan
    for span in (1, 3, 4, 49, 50, 80):
        np.testing.assert_array_equal(trailing_mean(x, span), gather_trailing_mean(x, span))


def test_declarations_unchanged_on_a_faulty_trace():
    # Recorded with the previous implementation (main at e2a5b95), whose continuity rule
    # was 120 s with gaps of up to 24 s: pinned here, this checks the scores alone.
    den = Denoiser.load(default_model_dir())
    grid = generate(SynthConfig(machines=32, duration_s=600, seed=2, fault="pfc_storm")).grid
    then = DetectConfig(continuity_s=120.0)
    alerts = declare(score_grid(grid, DetectConfig(), den), then, tuning=Tuning(max_gap_s=24.0)).alerts
    assert [(a.machine, a.metric, a.declared_at) for a in alerts] == [("node0028", "pfc_tx_packets", 271.0)]


def test_denoising_every_window_equals_denoising_the_complete_ones_alone():
    # denoised_windows runs gap windows through the LSTM too (zero-filled) and voids them
    # afterwards; the complete windows must come out as if denoised on their own.
    den = Denoiser.load(default_model_dir())
    rng = np.random.default_rng(4)
    win = rng.standard_normal((2, 37, 5, 8)).astype(np.float32)  # [metrics, machines, windows, window]
    win[0, 3, 1, 4] = np.nan
    win[1, 10:12, :, 0] = np.nan
    metrics = ["gpu_power", "step_time"]  # step metrics are not denoised
    rec = denoised_windows(win, metrics, den)  # [metrics, windows, window, machines]
    for k, metric in enumerate(metrics):
        for i in range(37):
            for w in range(5):
                got = rec[k, w, :, i]
                if np.isnan(win[k, i, w]).any():
                    assert np.isnan(got).all()
                elif metric == "step_time":
                    np.testing.assert_array_equal(got, win[k, i, w])
                else:
                    np.testing.assert_array_equal(got, den.reconstruct(metric, win[k, i, w][None])[0])


def test_window_means_and_maxima_are_numpys_bit_for_bit():
    """numpy's own mean and fmax over the last axis are the reference: heavy-tailed values
    (where the order of additions shows in the last bits), gaps, three float widths, window
    lengths on both sides of the 8 lanes and of 128, overlapping and not."""
    rng = np.random.default_rng(11)
    for dtype in (np.float16, np.float32, np.float64):
        for n in (2, 7, 8, 9, 16, 23, 32, 128, 129):
            x = np.clip(rng.standard_cauchy((3, 20, 30 * n + 5)) * 1e4, -6e4, 6e4).astype(dtype)  # float16 < 65504
            x[rng.random(x.shape) < 0.03] = np.nan
            for stride in (n, max(1, n // 3)):
                win = cut_windows(x, n, stride)
                np.testing.assert_array_equal(window_means(win), win.mean(-1))
                np.testing.assert_array_equal(window_maxima(win), np.fmax.reduce(win, axis=-1))


def score_arrays(scores):
    """Every array a call returns, straggler channel included."""
    arrays = {"z": scores.z, "instant": scores.instant, "deep": scores.deep_peak}
    if scores.straggler is not None:
        arrays["straggler"] = scores.straggler.z
    return arrays


@pytest.mark.parametrize(
    "spec",
    [
        dict(fault="gpu_drop"),
        dict(fault="flapping", distractors=True, step_metrics=True),
        dict(fault="straggler", step_metrics=True, step_period_s=(40.0, 90.0)),
    ],
)
def test_the_denoiser_on_a_second_thread_gives_the_same_bits(spec):
    den = Denoiser.load(default_model_dir())
    grid = generate(SynthConfig(machines=24, duration_s=600, seed=5, **spec)).grid
    one = score_grid(grid, DetectConfig(threads=1), den)
    two = score_grid(grid, DetectConfig(threads=2), den)
    a, b = score_arrays(one), score_arrays(two)
    assert a.keys() == b.keys() and one.metrics == two.metrics
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert (np.nan_to_num(a["z"]) > 0).any()  # real scores, not all void


class BrokenDenoiser:
    def reconstruct(self, metric, windows):
        raise RuntimeError(f"no model for {metric}")


def test_a_denoiser_error_on_the_second_thread_reaches_the_caller():
    grid = generate(SynthConfig(machines=8, duration_s=300, seed=5)).grid
    with pytest.raises(RuntimeError, match="no model for"):
        score_grid(grid, DetectConfig(threads=2), BrokenDenoiser())


def test_threads_other_than_one_or_two_are_refused():
    for bad in (0, 3):
        with pytest.raises(ValueError, match="threads must be 1 or 2"):
            DetectConfig(threads=bad)
