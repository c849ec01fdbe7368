"""LSTM-VAE denoiser: training reduces loss, save/load round-trip, fast path = autograd path."""

import numpy as np
import pytest
import torch

from megatron_rl.monitor.denoise import (
    DEFAULT_KEY,
    Denoiser,
    DenoiserConfig,
    LstmVae,
    WindowMedian,
    default_model_dir,
    train_denoiser,
    train_vae,
)
from megatron_rl.monitor.detect import DetectConfig, score_grid

TINY = DenoiserConfig(steps=8, batch=32)


def windows(n=400, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_t(3, size=(n, 8)).astype(np.float32)


def test_save_load_round_trip_gives_identical_outputs(tmp_path):
    den = train_denoiser({"gpu_power": windows(), "cpu_util": windows(seed=1)}, TINY)
    assert set(den.models) == {"gpu_power", "cpu_util", DEFAULT_KEY}
    path = den.save(tmp_path / "model")
    assert path.name == "denoiser.safetensors" and not list((tmp_path / "model").glob("*.tmp"))
    back = Denoiser.load(tmp_path / "model")
    assert back.cfg == den.cfg
    x = windows(50, seed=2)
    for metric in ("gpu_power", "cpu_util", "not_trained_metric"):
        np.testing.assert_array_equal(back.reconstruct(metric, x), den.reconstruct(metric, x))


def test_weights_file_holds_no_pickle(tmp_path):
    den = train_denoiser({"gpu_power": windows()}, TINY, pooled=False)
    raw = den.save(tmp_path).read_bytes()
    assert b"__reduce__" not in raw and not raw.startswith(b"\x80")  # a pickle starts with PROTO
    from safetensors import safe_open

    with safe_open(str(tmp_path / "denoiser.safetensors"), framework="pt") as f:
        assert sorted(f.keys())[0].startswith("m0.")


def test_fast_inference_equals_the_autograd_path():
    model = LstmVae(DenoiserConfig())
    x = windows(300)
    with torch.no_grad():
        mu, _ = model.encode(torch.from_numpy(x.T.copy()))
        ref = model.decode(mu, 8).numpy().T
    np.testing.assert_allclose(model.reconstruct(x, chunk=64), ref, atol=1e-5)


def test_a_windows_reconstruction_does_not_depend_on_the_batch_around_it():
    # What makes leaving out, reordering or reusing windows exact: each window alone, then
    # inside batches of odd sizes, at odd offsets, in chunks, as a transposed view.
    model = Denoiser.load(default_model_dir()).model_for("gpu_power")
    x = windows(1000, seed=3) * 4
    picked = (1, 2, 500, 997, 998)
    alone = {i: model.reconstruct(x[i : i + 1])[0] for i in picked}
    for start, stop, chunk in ((0, 1000, 16384), (0, 1000, 64), (1, 1000, 128), (2, 999, 16384)):
        got = model.reconstruct(np.ascontiguousarray(x[start:stop].T).T, chunk=chunk)
        for i in (i for i in picked if start <= i < stop):
            np.testing.assert_array_equal(got[i - start], alone[i])


def test_training_learns_to_keep_a_windows_level():
    # Windows = a random level + noise. An untrained VAE outputs about 0; a trained one
    # must reproduce the level, which is what the detector needs to keep.
    rng = np.random.default_rng(0)

    def data(n):
        return (rng.uniform(-5, 5, (n, 1)) + rng.normal(0, 0.3, (n, 8))).astype(np.float32)

    cfg = DenoiserConfig(steps=200, batch=64, lr=0.03, augment_level=0.0, augment_slope=0.0)
    trained, _ = train_vae(data(2000), cfg)
    torch.manual_seed(cfg.seed)
    untrained = LstmVae(cfg)  # the initialisation train_vae started from
    x = data(300)
    err_before = np.abs(untrained.reconstruct(x) - x).mean()
    err_after = np.abs(trained.reconstruct(x) - x).mean()
    assert err_after < 0.5 * err_before


def test_identity_without_a_model_and_window_mismatch():
    den = Denoiser({}, TINY)
    x = windows(5)
    np.testing.assert_array_equal(den.reconstruct("gpu_power", x), x)
    den = train_denoiser({"gpu_power": windows()}, TINY, pooled=False)
    with pytest.raises(ValueError, match="window_s"):
        den.reconstruct("gpu_power", np.zeros((3, 6), np.float32))


def test_load_missing_weights_says_how_to_make_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="train-denoiser"):
        Denoiser.load(tmp_path)


def test_window_median_ablation():
    x = np.array([[1, 2, 100, 3, 4, 5, 6, 7]], np.float32)
    np.testing.assert_array_equal(WindowMedian().reconstruct("m", x), np.full((1, 8), 4.5))


def test_detector_runs_with_a_denoiser(make_grid):
    grid = make_grid(machines=10, duration=200, faults=[(3, "gpu_power", 0, 200, -10.0)])
    den = train_denoiser({"gpu_power": windows()}, TINY)
    sc = score_grid(grid, DetectConfig(), den)
    assert sc.z.shape == (3, 10, 25) and np.nanargmax(np.nanmean(sc.z[2], axis=1)) == 3
