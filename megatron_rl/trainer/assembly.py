"""The step's training rows: prompt + response sequences in the training layout, with the
masks that say which tokens each loss and metric sees.

Every rank holds the whole step (the rollouts were all-gathered), so every rank builds the
same tensors; the schedules slice them per data-parallel rank. Layout: schedules.batch
("prediction-aligned": position t carries the prediction of token t + 1).

Which response tokens count where:
- policy loss (``loss_mask``): the tokens no earlier step trained on (T-PPO: earlier
  windows are context; without windows, the whole response), none of a response that used
  up the budget when the recipe filters those (DAPO's overlong filtering);
- train/inference mismatch (``fresh_mask``): the tokens vLLM sampled with the current
  weights (a T-PPO continuation's earlier tokens came from older weights);
- critic loss (``critic_mask``): finished responses only (a window's cut-off has no outcome yet).

A multi-turn episode's response holds tokens the environment appended (tool output, its chat
framing; ``Sample.sampled`` False): they are context, out of the policy loss and the
mismatch (the critic still values them, as it values every response token).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from megatron_rl.schedules.batch import TrainBatch, gather_response, pack_sequences, scatter_response
from megatron_rl.trainer.rollouts import TrainRows

Tensor = torch.Tensor


def response_span(lengths: Sequence[int], starts: Sequence[int], max_len: int) -> Tensor:
    """[rows, max_len] bool: response tokens starts[row] .. lengths[row] - 1."""
    positions = torch.arange(max_len)
    return (positions >= torch.tensor(starts)[:, None]) & (positions < torch.tensor(lengths)[:, None])


def aligned_span(
    prompt_lens: Sequence[int], response_lens: Sequence[int], starts: Sequence[int], seq_length: int
) -> Tensor:
    """[rows, seq_length] bool in the training layout: response tokens starts[row] onwards."""
    spans = response_span(response_lens, starts, max(response_lens))
    return scatter_response([m[:r] for m, r in zip(spans, response_lens)], prompt_lens, seq_length).bool()


@dataclasses.dataclass
class StepBatch:
    """One step's rows as [N, S] tensors, and what the phases of the step add to them."""

    rows: TrainRows
    tokens: Tensor
    """[N, S] int64: prompt + response, right-padded to trainer.seq_length."""
    response_mask: Tensor
    """[N, S] bool: every response token."""
    loss_mask: Tensor
    fresh_mask: Tensor
    critic_mask: Tensor
    prompt_lens: list[int]
    response_lens: list[int]
    temperature: Tensor
    """[N, S]: the temperature each token was sampled at (HAPO: per token)."""
    h_hat: Optional[Tensor] = None
    values: Optional[Tensor] = None
    old_logprobs: Optional[Tensor] = None
    rollout_logprobs: Optional[Tensor] = None
    """[N, S]: vLLM's logprobs of the tokens it sampled (the behaviour policy μ)."""
    is_weights: Optional[Tensor] = None
    """[N, S]: rollout-correction weights of the policy loss (None: off)."""
    ref_logprobs: Optional[Tensor] = None
    teacher_logprobs: Optional[Tensor] = None
    """[N, S]: on-policy distillation's teacher's logprobs of the sampled tokens (None: no teacher)."""
    advantages: Optional[Tensor] = None
    returns: Optional[Tensor] = None
    routes: Optional[Tensor] = None
    """MoE: [N, S, layers, k] int16, the experts vLLM routed each input token to (-1: none
    recorded, padding); None for dense models."""
    replay_routes: bool = False
    """rollout.router_replay: the actor's forward passes use ``routes``."""

    @property
    def lengths(self) -> Tensor:
        """[N] int64: real tokens (prompt + response) of each row."""
        return torch.tensor([p + r for p, r in zip(self.prompt_lens, self.response_lens)], dtype=torch.long)

    def forward_rows(self, loss_mask: Tensor) -> TrainBatch:
        """Tokens and lengths alone (critic values, HAPO's entropy pass)."""
        return TrainBatch(tokens=self.tokens, loss_mask=loss_mask, lengths=self.lengths)

    @property
    def max_response_len(self) -> int:
        return max(self.response_lens)

    def scatter(self, per_response: Sequence[Tensor]) -> Tensor:
        """Per-response-token values (lists or [rows, ≥ len] tensors) -> [N, S]."""
        return scatter_response(
            [torch.as_tensor(x)[:r] for x, r in zip(per_response, self.response_lens)],
            self.prompt_lens,
            self.tokens.shape[1],
        )

    def gather(self, tensor: Tensor) -> list[Tensor]:
        """[N, S] -> each row's response-token values."""
        return gather_response(tensor, self.prompt_lens, self.response_lens)

    def plain(self, loss_mask: Optional[Tensor] = None) -> TrainBatch:
        """The tokens, sampling temperatures and vLLM's routes (forward passes without
        targets; a model without a route replay ignores the routes)."""
        return TrainBatch(
            tokens=self.tokens,
            loss_mask=self.loss_mask if loss_mask is None else loss_mask,
            temperature=self.temperature,
            routes=self.routes,
            lengths=self.lengths,
        )

    def for_actor(self) -> TrainBatch:
        """Everything the policy loss reads."""
        return TrainBatch(
            tokens=self.tokens,
            loss_mask=self.loss_mask,
            advantages=self.advantages,
            temperature=self.temperature,
            old_logprobs=self.old_logprobs,
            ref_logprobs=self.ref_logprobs,
            h_hat=self.h_hat,
            returns=self.returns,
            is_weights=self.is_weights,
            routes=self.routes if self.replay_routes else None,
            old_values=self.values,
            is_positive=torch.tensor([c > 0 for c in self.rows.correct]),
            lengths=self.lengths,
        )

    def for_critic(self) -> TrainBatch:
        """The same rows, with the critic's tokens as the loss mask."""
        return dataclasses.replace(self.for_actor(), loss_mask=self.critic_mask)


def sampled_span(samples, prompt_lens: Sequence[int], seq_length: int) -> Tensor:
    """[N, S] bool in the training layout: False at the response tokens an environment
    appended (``Sample.sampled``), True elsewhere."""
    appended = [
        torch.tensor([not x for x in s.sampled], dtype=torch.bool)
        if s.sampled is not None
        else torch.zeros(len(s.token_ids), dtype=torch.bool)
        for s in samples
    ]
    return ~scatter_response(appended, prompt_lens, seq_length).bool()


def pack_routes(samples, seq_length: int) -> Optional[Tensor]:
    """[N, S, layers, k] int16 of the samples' routes at their input positions, -1 elsewhere;
    None unless every sample has routes (a dense model's have none)."""
    if not samples or any(s.routes is None for s in samples):
        return None
    routes = torch.full((len(samples), seq_length, *samples[0].routes.shape[1:]), -1, dtype=torch.int16)
    for row, s in enumerate(samples):
        length = min(s.routes.shape[0], seq_length)
        routes[row, :length] = s.routes[:length]
    return routes


def routes_missing(samples) -> float:
    """Share of (input token, layer) pairs of the samples without a vLLM route (prefix-cache
    hits): there the replay falls back to Megatron's router."""
    pairs = sum(s.routes[..., 0].numel() for s in samples)
    return sum(int((s.routes < 0).any(-1).sum()) for s in samples) / max(pairs, 1)


def assemble(
    rows: TrainRows,
    seq_length: int,
    pad_token_id: int,
    temperature: float,
    replay_routes: bool = False,
    filter_overlong: bool = False,
) -> StepBatch:
    """The step's rows in the training layout (a row longer than seq_length is refused).
    ``filter_overlong``: rows that used up the response budget get no policy-loss tokens."""
    prompts = [s.prompt_ids for s in rows.samples]
    responses = [s.token_ids for s in rows.samples]
    tokens, response_mask = pack_sequences(prompts, responses, seq_length, pad_token_id)
    prompt_lens, response_lens = [len(p) for p in prompts], [len(r) for r in responses]
    sampled = sampled_span(rows.samples, prompt_lens, seq_length)
    trained = sampled
    if filter_overlong:
        trained = sampled & ~torch.tensor([s.finish_reason == "length" for s in rows.samples])[:, None]
    return StepBatch(
        rows=rows,
        tokens=tokens,
        response_mask=response_mask,
        loss_mask=aligned_span(prompt_lens, response_lens, rows.loss_start, seq_length) & trained,
        fresh_mask=aligned_span(prompt_lens, response_lens, rows.fresh_start, seq_length) & sampled,
        critic_mask=response_mask & ~torch.tensor(rows.truncated)[:, None],
        prompt_lens=prompt_lens,
        response_lens=response_lens,
        temperature=torch.full(tokens.shape, temperature),
        routes=pack_routes(rows.samples, seq_length),
        replay_routes=replay_routes,
    )
