"""Replay one GRPO run's recorded rows through a plain reference learner, step by step.

The reference is the run's base loaded as a Hugging Face model in fp32, the loss of
:mod:`.grpo_reference_loss` and torch's AdamW with the settings our Megatron optimizer
gets. It learns from the samples and rewards alone: its old logprobs are its own (its
policy before the step's update), its advantages its own (the formula on the recorded
rewards and groups). Our run's numbers are only compared with, never fed in:

- ``logp_abs_diff_*``: |log π_ref − old_logprobs| over the policy-loss tokens, both
  policies before the step's update. Step 1 is the same weights: this is the forward pass
  alone (fp32 Megatron against fp32 transformers, ~1e-6); later steps add what the updates
  did differently.
- ``moved_mean``: |old_logprobs − log π_start| over the same tokens, π_start the run's
  base: how far our policy has moved from where both started, the scale the distance
  above is read against.
- ``fp64_vs_*`` (``control``): a second reference in float64 learns from the same rows;
  its distance to the fp32 reference is the noise floor of a plain fp32 implementation,
  its distance to ours says which of the two fp32 learners is nearer the exact one.
- ``twin_vs_*`` (``control``): a third reference, fp32, that takes each mini-batch's rows in
  reverse order: the same loss (a sum over rows), other roundings. Its distance to the fp32
  reference is how far two plain fp32 writings of one learner drift apart by rounding alone,
  the floor our distance to the reference is read against.
- ``advantage_max_abs_diff``: the reference's advantages against the recorded ones.
- ``loss_mask_mismatch``: policy-loss tokens the recorded mask and the reference's (the
  response from ``loss_start`` on) disagree on.
- the reference's ``pg_loss``, ``clipfrac`` and ``grad_norm`` (means over the step's
  mini-batches, as metrics.jsonl's are) beside ours.

The update is split as the trainer splits it: ``algorithm.ppo_epochs`` passes, each
``algorithm.mini_batches_per_step`` consecutive slices of the rows in recorded order (or in
:func:`megatron_rl.schedules.batch.epoch_order`'s order under
``algorithm.shuffle_mini_batches``), one optimizer step per slice after clipping the
gradient norm. The learning rate follows the trainer's warm-up. What the reference does not
write is refused before any work (:func:`check_supported`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional, Sequence

import torch

from megatron_rl_lab.bench import grpo_reference_loss as ref_loss

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
WEIGHT_DECAY = 0.0
"""Megatron-Core 0.16.1's OptimizerConfig defaults (adam_beta1/2, adam_eps), and the weight
decay ``models.builder.wrap_for_training`` passes; on the CPU, Megatron's "adam" is torch's
AdamW (decoupled weight decay, 0 here, so Adam and AdamW are the same update)."""
CLIP_GRAD = 1.0
"""The gradient-norm clip of the actor (``from_config.setup.build_trainable``'s default)."""


class ReplayError(ValueError):
    """A run the reference cannot replay (a recipe piece it does not write, missing rows)."""


@dataclasses.dataclass(frozen=True)
class ReplaySettings:
    """What the reference reads from the run's config.yaml."""

    clip_low: float
    clip_high: float
    loss_agg: str
    norm_by_std: bool
    kl_kind: Optional[str]
    kl_coef: float
    temperature: float
    mini_batches: int
    ppo_epochs: int
    shuffle: bool
    seed: int
    lr: float
    lr_warmup_steps: int

    def lr_at(self, step: int) -> float:
        """The trainer's schedule: linear warm-up over lr_warmup_steps, then constant."""
        warm = self.lr_warmup_steps
        return self.lr * (min(1.0, step / warm) if warm else 1.0)


def check_supported(cfg) -> None:
    """Refuse, in one line, a run whose update has pieces the reference does not write."""
    recipe = cfg.algorithm.build()
    unsupported = {
        "advantage_estimator": recipe.advantage_estimator != "grpo",
        "whiten_advantages": recipe.whiten_advantages,
        "use_critic": recipe.use_critic,
        "clip_c": recipe.clip_c is not None,
        "positive_nll_coef": recipe.positive_nll_coef > 0,
        "rollout_correction": recipe.rollout_correction is not None,
        "overlong_filter": recipe.overlong_filter,
        "generation_window": recipe.generation_window is not None,
        "temperature_tau": recipe.temperature_tau > 0,
        "entropy_clip_alpha": recipe.entropy_clip_alpha > 0,
        "redistribution_beta": recipe.redistribution_beta > 0,
    }
    named = [name for name, on in unsupported.items() if on]
    if named:
        raise ReplayError(f"recipe {recipe.name!r}: the reference writes plain GRPO only, not {', '.join(named)}")
    if recipe.kl is not None and recipe.kl.kind != "k3":
        raise ReplayError(f"algorithm kl.kind={recipe.kl.kind!r}: the reference writes k3")
    if recipe.loss_agg not in ref_loss.AGGREGATIONS:
        raise ReplayError(f"algorithm loss_agg={recipe.loss_agg!r}: the reference writes {ref_loss.AGGREGATIONS}")
    if cfg.model.moe_aux_loss_coeff != 0:
        raise ReplayError(
            f"model.moe_aux_loss_coeff={cfg.model.moe_aux_loss_coeff}: the reference has no load-balancing loss"
        )
    if cfg.model.dtype != "fp32":
        raise ReplayError(f"model.dtype={cfg.model.dtype}: the reference compares fp32 runs")


def replay_settings(cfg) -> ReplaySettings:
    check_supported(cfg)
    recipe = cfg.algorithm.build()
    return ReplaySettings(
        clip_low=recipe.clip_low,
        clip_high=recipe.clip_high,
        loss_agg=recipe.loss_agg,
        norm_by_std=recipe.norm_by_std,
        kl_kind=None if recipe.kl is None else recipe.kl.kind,
        kl_coef=0.0 if recipe.kl is None else recipe.kl.coef,
        temperature=cfg.rollout.temperature,
        mini_batches=cfg.algorithm.mini_batches_per_step,
        ppo_epochs=cfg.algorithm.ppo_epochs,
        shuffle=cfg.algorithm.shuffle_mini_batches,
        seed=cfg.trainer.seed,
        lr=cfg.trainer.lr,
        lr_warmup_steps=cfg.trainer.lr_warmup_steps,
    )


# -- the rows ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepRows:
    """One step's records as [B, S] tensors, position t holding what predicts token t + 1."""

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    """The reference's own: every response token from ``loss_start`` on."""
    recorded_mask: torch.Tensor
    old_logprobs: torch.Tensor
    """Ours (Megatron's), for the comparison only."""
    advantages: torch.Tensor
    """Ours, for the comparison only."""
    rewards: list[float]
    groups: list[int]
    response_lens: list[int]
    prompt_lens: list[int]

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    def spread(self, per_row: Sequence[float]) -> torch.Tensor:
        """A value per row on each of its response tokens ([B, S] float64, 0 elsewhere)."""
        out = torch.zeros(self.tokens.shape, dtype=torch.float64)
        for row, (p, r) in enumerate(zip(self.prompt_lens, self.response_lens)):
            out[row, p - 1 : p - 1 + r] = per_row[row]
        return out


def step_rows(records: Sequence[dict], pad_id: int = 0) -> StepRows:
    """The records of one step (trainer/rollout_log.py) as padded tensors."""
    seq = max(len(r["prompt_ids"]) + len(r["token_ids"]) for r in records)
    shape = (len(records), seq)
    tokens = torch.full(shape, pad_id, dtype=torch.long)
    mask, recorded = torch.zeros(shape, dtype=torch.bool), torch.zeros(shape, dtype=torch.bool)
    old, adv = torch.zeros(shape), torch.zeros(shape)
    for row, r in enumerate(records):
        p, n = len(r["prompt_ids"]), len(r["token_ids"])
        tokens[row, : p + n] = torch.tensor(r["prompt_ids"] + r["token_ids"])
        span = slice(p - 1, p - 1 + n)  # the positions that predict the response tokens
        mask[row, span] = torch.arange(n) >= r["loss_start"]
        recorded[row, span] = torch.tensor(r["loss_mask"], dtype=torch.bool)
        old[row, span] = torch.tensor(r["old_logprobs"])
        adv[row, span] = torch.tensor(r["advantages"])
    return StepRows(
        tokens,
        mask,
        recorded,
        old,
        adv,
        rewards=[r["reward"] for r in records],
        groups=[r["group_index"] for r in records],
        response_lens=[len(r["token_ids"]) for r in records],
        prompt_lens=[len(r["prompt_ids"]) for r in records],
    )


def token_logprobs(model, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, S]: log π(tokens[:, t + 1] | tokens[:, ≤ t]) at ``temperature``, in the model's
    dtype (fp32 at least); 0 at the last position. Right padding needs no attention mask:
    causal attention never reads it."""
    logits = model(input_ids=tokens, output_router_logits=False).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (0, 1))


# -- one step ------------------------------------------------------------------------------


def mini_batch_orders(settings: ReplaySettings, rows: int, step: int) -> list[list[int]]:
    """The rows of every optimizer step of this training step, epoch by epoch."""
    size = rows // settings.mini_batches
    out = []
    for epoch in range(settings.ppo_epochs):
        order = list(range(rows))
        if settings.shuffle:
            from megatron_rl.schedules.batch import epoch_order

            order = epoch_order(rows, settings.seed, step, epoch).tolist()
        out += [order[m * size : (m + 1) * size] for m in range(settings.mini_batches)]
    return out


@dataclasses.dataclass
class Learner:
    """A reference policy and its optimizer (and, with a KL penalty, its frozen start)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    base: Optional[torch.nn.Module] = None
    reverse_rows: bool = False
    """Take each mini-batch's rows in reverse order (the twin: the same loss, other roundings)."""

    @classmethod
    def load(
        cls, base_dir: Path, settings: ReplaySettings, dtype: torch.dtype = torch.float32, reverse_rows: bool = False
    ) -> "Learner":
        model = load_reference(base_dir, dtype)
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=settings.lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY
        )
        base = load_reference(base_dir, dtype) if settings.kl_kind is not None else None
        return cls(model, optimizer, base, reverse_rows)


def mini_batch_loss(learner: Learner, rows: StepRows, index, old, advantages, settings: ReplaySettings, ref_logp):
    """The reference's loss on the rows ``index``, its policy-loss part and clip fraction."""
    mask = rows.loss_mask[index]
    logp = token_logprobs(learner.model, rows.tokens[index], settings.temperature)
    per_token, clipped = ref_loss.clipped_surrogate(
        logp, old[index], advantages[index], settings.clip_low, settings.clip_high
    )
    pg = ref_loss.aggregate(per_token, mask, settings.loss_agg)
    total = pg
    if settings.kl_kind is not None:
        total = pg + settings.kl_coef * ref_loss.aggregate(ref_loss.k3(logp, ref_logp[index]), mask, settings.loss_agg)
    clipfrac = (clipped & mask).sum() / mask.sum().clamp_min(1)
    return total, float(pg.detach()), float(clipfrac)


def replay_step(learner: Learner, rows: StepRows, settings: ReplaySettings, step: int) -> tuple[torch.Tensor, dict]:
    """The learner's logprobs of the rows before the update ([B, S]), then its update as the
    trainer updates ours; and its own numbers of the step."""
    with torch.no_grad():
        logp = token_logprobs(learner.model, rows.tokens, settings.temperature)
        ref_logp = token_logprobs(learner.base, rows.tokens, settings.temperature) if learner.base is not None else None
    per_row = ref_loss.group_advantages(rows.rewards, rows.groups, by_std=settings.norm_by_std)
    advantages = rows.spread(per_row).to(logp.dtype)
    out = {"advantage_max_abs_diff": float((advantages - rows.advantages).abs()[rows.loss_mask].max())}
    for group in learner.optimizer.param_groups:
        group["lr"] = settings.lr_at(step)
    params = [p for p in learner.model.parameters() if p.requires_grad]
    pg_losses, clipfracs, grad_norms = [], [], []
    for index in mini_batch_orders(settings, rows.num_rows, step):
        index = torch.tensor(index[::-1] if learner.reverse_rows else index)
        loss, pg, clipfrac = mini_batch_loss(learner, rows, index, logp, advantages, settings, ref_logp)
        learner.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP_GRAD)))
        learner.optimizer.step()
        pg_losses.append(pg)
        clipfracs.append(clipfrac)
    out["pg_loss"] = sum(pg_losses) / len(pg_losses)
    out["clipfrac"] = sum(clipfracs) / len(clipfracs)
    out["grad_norm"] = sum(grad_norms) / len(grad_norms)
    return logp, out


def abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """Mean and max of |a − b| over ``mask`` (in float64)."""
    diff = (a.double() - b.double()).abs()[mask]
    return float(diff.mean()), float(diff.max())


# -- one run -------------------------------------------------------------------------------

OURS = {"pg_loss": "actor/pg_loss", "clipfrac": "actor/clipfrac", "grad_norm": "actor/grad_norm"}
"""Our metrics.jsonl keys printed beside the reference's."""


def load_reference(base_dir: Path, dtype: torch.dtype = torch.float32):
    """The run's base as a transformers model: eager attention and eager experts (a loop over
    the experts: the plain writing, the same on every install, and the one that takes float64)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(base_dir), dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    )
    return model.eval()


@dataclasses.dataclass
class Controls:
    """The references beside the main one (``replay_run``'s ``control``)."""

    exact: Learner
    """float64."""
    twin: Learner
    """fp32, each mini-batch's rows reversed."""
    start: torch.nn.Module
    """The run's base, frozen: how far our policy has moved."""


def compare_step(step: int, rows: StepRows, main: Learner, controls: Optional[Controls], settings, ours: dict) -> dict:
    """One step of the replay: the learners' comparisons before the update, then their updates."""
    logp, own = replay_step(main, rows, settings, step)
    mean, top = abs_diff(logp, rows.old_logprobs, rows.loss_mask)
    result = {
        "step": step,
        "rows": rows.num_rows,
        "loss_tokens": int(rows.loss_mask.sum()),
        "logp_abs_diff_mean": mean,
        "logp_abs_diff_max": top,
        "advantage_max_abs_diff": own.pop("advantage_max_abs_diff"),
        "loss_mask_mismatch": int((rows.loss_mask != rows.recorded_mask).sum()),
        **{f"ref_{k}": v for k, v in own.items()},
        **{f"ours_{name}": ours.get(key) for name, key in OURS.items()},
    }
    if controls is not None:
        result.update(control_distances(step, rows, logp, controls, settings))
    return result


def control_distances(step: int, rows: StepRows, logp: torch.Tensor, controls: Controls, settings) -> dict:
    """The controls' distances to the reference (``logp``) and to ours, then their updates."""
    mask, ours = rows.loss_mask, rows.old_logprobs
    out = {}
    with torch.no_grad():
        initial = token_logprobs(controls.start, rows.tokens, settings.temperature)
    out["moved_mean"], out["moved_max"] = abs_diff(initial, ours, mask)
    for name, learner in (("fp64", controls.exact), ("twin", controls.twin)):
        theirs, _ = replay_step(learner, rows, settings, step)
        out[f"{name}_vs_ours_mean"], out[f"{name}_vs_ours_max"] = abs_diff(theirs, ours, mask)
        out[f"{name}_vs_ref_mean"], out[f"{name}_vs_ref_max"] = abs_diff(theirs, logp, mask)
    return out


def replay_run(
    run_dir: Path, base_dir: Path, steps: int, settings: ReplaySettings, control: bool = True, say=print
) -> list[dict]:
    """Every step 1..steps of the run, per step. ``control``: the float64 reference and the
    fp32 twin learn beside the main one (:class:`Controls`): the noise floor."""
    from megatron_rl.trainer.rollout_log import read_rollouts, step_path

    main = Learner.load(base_dir, settings)
    controls = None
    if control:
        exact = Learner.load(base_dir, settings, torch.float64)
        twin = Learner.load(base_dir, settings, reverse_rows=True)
        controls = Controls(exact, twin, load_reference(base_dir))
    ours = {row["step"]: row for row in _metrics_rows(run_dir)}
    out = []
    for step in range(1, steps + 1):
        path = step_path(run_dir, step)
        if not path.is_file():
            raise ReplayError(f"{path} is missing: train with trainer.save_rollouts=true")
        result = compare_step(step, step_rows(read_rollouts(path)), main, controls, settings, ours.get(step, {}))
        out.append(result)
        say(step_line(result))
    return out


def step_line(result: dict) -> str:
    line = (
        f"step {result['step']:3d}  |dlogp| ref-ours mean {result['logp_abs_diff_mean']:.2e}"
        f" max {result['logp_abs_diff_max']:.2e}"
    )
    if "fp64_vs_ref_mean" in result:
        line += (
            f"  moved {result['moved_mean']:.2e}  twin-ref {result['twin_vs_ref_mean']:.2e}"
            f"  fp64-ref {result['fp64_vs_ref_mean']:.2e}  fp64-ours {result['fp64_vs_ours_mean']:.2e}"
        )
    return line + (
        f"  pg ref {result['ref_pg_loss']:+.5f} ours {_fmt(result['ours_pg_loss'])}"
        f"  grad_norm ref {result['ref_grad_norm']:.5f} ours {_fmt(result['ours_grad_norm'], '.5f')}"
    )


def _metrics_rows(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _fmt(value, spec: str = "+.5f") -> str:
    return "n/a" if value is None else format(value, spec)
