"""One small LSTM-VAE per metric that denoises normalised metric windows.

The published design (1 LSTM layer, hidden 4, latent 8) is trained unsupervised on
normal windows and its reconstruction replaces the raw window before machines are
compared, so one-second jitter and single-sample glitches stop looking like outliers.

Two choices that are ours, not the paper's:
- Training adds a random level and slope to each window. Normal residual windows sit
  near zero, and a VAE that has only seen those learns to draw every window back to
  zero, erasing the very offsets a faulty machine shows. With the augmentation it keeps
  a window's level and trend and drops what varies from second to second.
- The LSTM is written out in [time, batch] layout with tanh(x) = 2*sigmoid(2x) - 1:
  on one CPU core this runs 3-4x faster than torch.nn.LSTM at hidden size 4, which is
  what brings a 1024-machine call under a second.

Weights are saved with safetensors (no pickle); the config travels in its metadata.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
from torch import nn

WEIGHTS_FILE = "denoiser.safetensors"
DEFAULT_KEY = "*"  # model for metrics that have none of their own (pooled training)
PACKAGED_DIR = Path(__file__).parent / "weights"  # trained on synthetic fault-free traces


def default_model_dir() -> Path | None:
    """The packaged denoiser (see docs/monitor.md for how it was trained), if installed."""
    return PACKAGED_DIR if (PACKAGED_DIR / WEIGHTS_FILE).exists() else None


@dataclass(frozen=True)
class DenoiserConfig:
    """Architecture and training of the per-metric LSTM-VAEs."""

    window: int = 8
    """Samples per window (seconds at 1 Hz); must equal the detector's window."""
    hidden: int = 4
    """LSTM hidden size of encoder and decoder."""
    latent: int = 8
    """Latent dimension."""
    beta: float = 0.002
    """KL weight. Small on purpose: a larger one (0.05) shrinks small level offsets to
    zero while keeping large ones, which turns mild, harmless per-machine differences
    into outliers (on the tuning seeds F1 0.90 at 0.05, 0.97 at 0.01, 1.00 at 0.002)."""
    clip: float = 30.0
    """Inputs are clipped to +-clip spread units; larger deviations are outliers anyway."""
    augment_level: float = 12.0
    """Training adds a level drawn from U(-a, a) spread units to each window."""
    augment_slope: float = 6.0
    """... and a linear trend whose end-to-end change is drawn from U(-a, a)."""
    steps: int = 600
    """Adam steps per metric."""
    batch: int = 512
    lr: float = 1e-2
    seed: int = 0

    def __post_init__(self):
        for name in ("window", "hidden", "latent", "steps", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"DenoiserConfig.{name} = {getattr(self, name)}; must be >= 1")
        if self.beta < 0 or self.clip <= 0 or self.lr <= 0:
            raise ValueError("DenoiserConfig: beta must be >= 0, clip and lr > 0")


@contextlib.contextmanager
def one_thread():
    """Run torch on one intra-op thread, then restore. These matrices are tiny: threads
    gain nothing, and on a busy machine (or beside a trainer) OpenMP workers spinning
    for them turn milliseconds into seconds."""
    n = torch.get_num_threads()
    if n != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n != 1:
            torch.set_num_threads(n)


def _lstm(
    x_in: torch.Tensor | None,
    const_in: torch.Tensor | None,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b: torch.Tensor,
    steps: int,
) -> torch.Tensor:
    """LSTM over [steps, batch]; gate order (i, f, o, g). Returns hidden states [steps, H, B].

    x_in: [steps, batch] scalar inputs, or None when `const_in` [4H, B] (the decoder's
    projected latent) is the same input at every step.
    """
    h4 = w_hh.shape[0]
    hid = h4 // 4
    batch = x_in.shape[1] if x_in is not None else const_in.shape[1]
    h = torch.zeros(hid, batch, dtype=w_hh.dtype)
    c = torch.zeros(hid, batch, dtype=w_hh.dtype)
    scale = torch.ones(h4, 1, dtype=w_hh.dtype)
    scale[3 * hid :] = 2.0  # g gate: tanh(x) = 2*sigmoid(2x) - 1
    base = b[:, None] if const_in is None else const_in + b[:, None]
    outs = []
    for t in range(steps):
        g = torch.addmm(base, w_hh, h)
        if x_in is not None:
            g = g + w_ih * x_in[t]  # w_ih is [4H, 1]: an outer product
        s = torch.sigmoid(g * scale)
        gg = 2.0 * s[3 * hid :] - 1.0
        c = s[hid : 2 * hid] * c + s[:hid] * gg
        h = s[2 * hid : 3 * hid] * (2.0 * torch.sigmoid(2.0 * c) - 1.0)
        outs.append(h)
    return torch.stack(outs)


class LstmVae(nn.Module):
    """Encoder LSTM -> (mu, logvar) -> decoder LSTM fed z at every step -> linear output."""

    def __init__(self, cfg: DenoiserConfig):
        super().__init__()
        self.cfg = cfg
        h, z = cfg.hidden, cfg.latent
        k = 1.0 / math.sqrt(h)
        u = lambda *shape: nn.Parameter(torch.empty(*shape).uniform_(-k, k))  # noqa: E731
        self.enc_w_ih, self.enc_w_hh, self.enc_b = u(4 * h, 1), u(4 * h, h), u(4 * h)
        self.mu_w, self.mu_b = u(z, h), u(z)
        self.lv_w, self.lv_b = u(z, h), u(z)
        self.dec_w_ih, self.dec_w_hh, self.dec_b = u(4 * h, z), u(4 * h, h), u(4 * h)
        self.out_w, self.out_b = u(1, h), u(1)
        with torch.no_grad():  # forget-gate bias 1: the usual LSTM initialisation
            self.enc_b[h : 2 * h] = 1.0
            self.dec_b[h : 2 * h] = 1.0

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [window, batch] -> mu, logvar: [latent, batch]."""
        hs = _lstm(x, None, self.enc_w_ih, self.enc_w_hh, self.enc_b, x.shape[0])
        h_last = hs[-1]
        return self.mu_w @ h_last + self.mu_b[:, None], self.lv_w @ h_last + self.lv_b[:, None]

    def decode(self, z: torch.Tensor, steps: int) -> torch.Tensor:
        """z: [latent, batch] -> reconstruction [steps, batch]."""
        hs = _lstm(None, self.dec_w_ih @ z, self.dec_w_ih, self.dec_w_hh, self.dec_b, steps)
        return torch.einsum("oh,thb->tb", self.out_w, hs) + self.out_b

    def loss(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Negative ELBO per sample, averaged over the batch.

        The likelihood is Laplace (absolute error), not Gaussian: metric residuals are
        heavy-tailed (a second caught mid-step, a sensor glitch), and under squared error
        the VAE spends its capacity reproducing exactly those spikes.
        """
        mu, logvar = self.encode(x)
        z = mu + torch.randn(mu.shape, generator=gen) * torch.exp(0.5 * logvar)
        recon = self.decode(z, x.shape[0])
        rec = (recon - x).abs().sum(0)
        kl = -0.5 * (1 + logvar - mu**2 - logvar.exp()).sum(0)
        return (rec + self.cfg.beta * kl).mean() / x.shape[0]

    @torch.inference_mode()
    @one_thread()
    def reconstruct(self, windows: np.ndarray, chunk: int = 16384) -> np.ndarray:
        """[batch, window] float -> reconstructions [batch, window] float32 (z = mu).

        Each window's result depends on that window alone, bit for bit, wherever it sits
        in the batch: the batch is zero-padded to a multiple of LANES (see there). A
        transposed view of a time-major [window, batch] array costs no copy beyond the clip.
        """
        n, steps = windows.shape
        width = -(-n // LANES) * LANES
        xt = torch.zeros(steps, width)  # time-major, padded
        np.clip(np.asarray(windows, np.float32).T, -self.cfg.clip, self.cfg.clip, out=xt.numpy()[:, :n])
        out = torch.empty(steps, width)
        enc = _prescaled(self.enc_w_ih, self.enc_w_hh, self.enc_b)
        dec = _prescaled(self.dec_w_ih, self.dec_w_hh, self.dec_b)
        chunk = max(LANES, chunk // LANES * LANES)
        for i in range(0, width, chunk):
            h = _lstm_inference(xt[:, i : i + chunk], None, *enc, steps)
            mu = torch.addmm(self.mu_b[:, None], self.mu_w, h)

            def emit(t, h_t, o=out[:, i : i + chunk]):  # this chunk's output columns, bound now
                torch.addmm(self.out_b[:, None], self.out_w, h_t, out=o[t : t + 1])

            _lstm_inference(None, dec[0] @ mu, *dec, steps, emit)
        return out.numpy()[:, :n].T


LANES = 64
"""Batch multiple for inference. torch's element-wise CPU kernels run SIMD over blocks
of two vectors (16 float32 with AVX2, 32 with AVX-512) and finish a row's remainder with
scalar code, whose exp rounds differently in the last bit. Unpadded, the last few windows
of a chunk would get slightly different numbers than the same windows elsewhere, so a
window's score would depend on how many other windows were complete."""


def _prescaled(w_ih: torch.Tensor, w_hh: torch.Tensor, b: torch.Tensor):
    """Weights with the g-gate rows doubled, so one sigmoid serves all four gates."""
    s = torch.ones(w_hh.shape[0], 1)
    s[3 * (w_hh.shape[0] // 4) :] = 2.0
    return w_ih * s, w_hh * s, b[:, None] * s


def _lstm_inference(x_in, const_in, w_ih, w_hh, b, steps: int, emit=None) -> torch.Tensor:
    """In-place twin of `_lstm` for inference (prescaled weights); returns the last h.

    `const_in` is already w_ih @ z with prescaled w_ih. `emit(t, h)` sees every hidden state.
    """
    hid = w_hh.shape[0] // 4
    batch = x_in.shape[1] if x_in is not None else const_in.shape[1]
    base = b if const_in is None else const_in + b
    g = torch.empty(4 * hid, batch)
    h, c2, tmp = torch.zeros(hid, batch), torch.zeros(hid, batch), torch.empty(hid, batch)
    minus2, minus1 = torch.tensor(-2.0), torch.tensor(-1.0)
    # c2 is twice the cell state: tanh(c) = 2*sigmoid(2c) - 1 then needs no doubling pass,
    # and the g gate is kept doubled too (4s - 2 = 2*tanh). Scaling by 2 is exact in
    # floating point, so this gives the same bits as keeping c; -k + a*s is one pass
    # where s.mul_(a).sub_(k) would be two, with the same rounding (a*s is exact).
    for t in range(steps):
        torch.addmm(base, w_hh, h, out=g)
        if x_in is not None:
            g.addcmul_(w_ih, x_in[t : t + 1])
        g.sigmoid_()
        gg2 = torch.add(minus2, g[3 * hid :], alpha=4.0, out=g[3 * hid :])
        c2.mul_(g[hid : 2 * hid]).addcmul_(g[:hid], gg2)
        torch.add(minus1, torch.sigmoid(c2, out=tmp), alpha=2.0, out=tmp)
        torch.mul(g[2 * hid : 3 * hid], tmp, out=h)
        if emit is not None:
            emit(t, h)
    return h


class Denoiser:
    """The per-metric LSTM-VAEs; metrics without their own model use the pooled one."""

    def __init__(self, models: dict[str, LstmVae], cfg: DenoiserConfig):
        self.models = models
        self.cfg = cfg

    def model_for(self, metric: str) -> LstmVae | None:
        return self.models.get(metric, self.models.get(DEFAULT_KEY))

    def reconstruct(self, metric: str, windows: np.ndarray) -> np.ndarray:
        """Denoised windows; identity where no model applies."""
        model = self.model_for(metric)
        if model is None or windows.shape[0] == 0:
            return np.asarray(windows, np.float32)
        if windows.shape[1] != self.cfg.window:
            raise ValueError(
                f"denoiser was trained on {self.cfg.window}-sample windows, "
                f"got {windows.shape[1]}; set the detector's window_s to match"
            )
        return model.reconstruct(windows)

    def save(self, directory: str | Path) -> Path:
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        names = list(self.models)
        tensors = {
            f"m{i}.{p}": t.detach().contiguous()
            for i, name in enumerate(names)
            for p, t in self.models[name].named_parameters()
        }
        meta = {"config": json.dumps(asdict(self.cfg)), "metrics": json.dumps(names), "format": "1"}
        path = d / WEIGHTS_FILE
        tmp = d / (WEIGHTS_FILE + ".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        os.chmod(tmp, 0o644)
        tmp.replace(path)  # never a half-written weights file
        return path

    @classmethod
    def load(cls, directory: str | Path) -> "Denoiser":
        from safetensors import safe_open

        path = Path(directory)
        path = path / WEIGHTS_FILE if path.is_dir() else path
        if not path.exists():
            raise FileNotFoundError(
                f"{path}: no denoiser weights; create them with `monitor train-denoiser --out {path.parent}`"
            )
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        known = {f.name for f in fields(DenoiserConfig)}
        cfg = DenoiserConfig(**{k: v for k, v in json.loads(meta["config"]).items() if k in known})
        models = {}
        for i, name in enumerate(json.loads(meta["metrics"])):
            model = LstmVae(cfg)
            model.load_state_dict({p: tensors[f"m{i}.{p}"] for p, _ in model.named_parameters()})
            models[name] = model.eval()
        return cls(models, cfg)


def _augment(x: torch.Tensor, cfg: DenoiserConfig, gen: torch.Generator) -> torch.Tensor:
    """Add a random level and trend to each window (see the module docstring for why)."""
    w, b = x.shape
    level = (torch.rand(1, b, generator=gen) * 2 - 1) * cfg.augment_level
    slope = (torch.rand(1, b, generator=gen) * 2 - 1) * cfg.augment_slope
    ramp = (torch.arange(w, dtype=x.dtype)[:, None] / max(w - 1, 1)) - 0.5
    return (x + level + slope * ramp).clamp(-cfg.clip, cfg.clip)


class _Adam:
    """Plain Adam with a cosine learning-rate decay and global-norm clipping.

    Hand-written because constructing any torch.optim optimizer imports torch._dynamo,
    which takes 2-8 s: longer than training these ~400 parameters does.
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        lr: float,
        steps: int,
        clip: float = 5.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ):
        self.params, self.lr, self.steps, self.clip, self.betas, self.eps = params, lr, steps, clip, betas, eps
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.t = 0

    @torch.no_grad()
    def step(self) -> None:
        grads = [p.grad for p in self.params]
        norm = torch.sqrt(sum((g * g).sum() for g in grads))
        scale = min(1.0, self.clip / (float(norm) + 1e-12))
        lr = self.lr * 0.5 * (1 + math.cos(math.pi * self.t / self.steps))
        self.t += 1
        b1, b2 = self.betas
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            g = g * scale
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v / (1 - b2**self.t)).sqrt_().add_(self.eps)
            p.addcdiv_(m, denom, value=-lr / (1 - b1**self.t))
            p.grad = None


@one_thread()
def train_vae(windows: np.ndarray, cfg: DenoiserConfig, seed: int = 0) -> tuple[LstmVae, float]:
    """Fit one LSTM-VAE on normal windows [n, window]; returns (model, final loss)."""
    if windows.ndim != 2 or windows.shape[1] != cfg.window or windows.shape[0] == 0:
        raise ValueError(f"training windows must be [n>0, {cfg.window}], got {windows.shape}")
    torch.manual_seed(cfg.seed + seed)
    gen = torch.Generator().manual_seed(cfg.seed + seed)
    model = LstmVae(cfg)
    data = torch.from_numpy(np.clip(windows, -cfg.clip, cfg.clip).astype(np.float32).T.copy())
    opt = _Adam(list(model.parameters()), cfg.lr, cfg.steps)
    recent: list[float] = []
    for _ in range(cfg.steps):
        idx = torch.randint(0, data.shape[1], (min(cfg.batch, data.shape[1]),), generator=gen)
        loss = model.loss(_augment(data[:, idx], cfg, gen), gen)
        loss.backward()
        opt.step()
        recent = (recent + [loss.item()])[-20:]
    return model.eval(), float(np.mean(recent))


def train_denoiser(
    windows: dict[str, np.ndarray], cfg: DenoiserConfig = DenoiserConfig(), pooled: bool = True, log=None
) -> Denoiser:
    """One VAE per metric, plus (if `pooled`) a default VAE on all metrics' windows."""
    models = {}
    items = [(m, w) for m, w in windows.items() if len(w)]
    if pooled and items:
        rng = np.random.default_rng(cfg.seed)
        per = max(1, 50_000 // len(items))
        parts = [w[rng.choice(len(w), min(per, len(w)), replace=False)] for _, w in items]
        items.append((DEFAULT_KEY, np.concatenate(parts)))
    for i, (metric, w) in enumerate(items):
        models[metric], loss = train_vae(w, cfg, seed=i)
        if log:
            log(f"denoiser {metric}: {len(w)} windows, final loss {loss:.4f}")
    return Denoiser(models, cfg)


class WindowMedian:
    """Ablation stand-in for `Denoiser`: every window becomes its own median.

    The simplest robust smoother; the evaluation runs it to show how much of the
    denoiser's gain a fixed rule already gets.
    """

    def reconstruct(self, metric: str, windows: np.ndarray) -> np.ndarray:
        med = np.median(windows, axis=1, keepdims=True)
        return np.broadcast_to(med, windows.shape).astype(np.float32)
