"""The training batch: [N, S] tensors padded to a fixed sequence length.

Alignment ("prediction-aligned"): position t of every per-token tensor belongs to the
prediction made AT position t, i.e. to token t + 1. `loss_mask[n, t] = 1` means
tokens[n, t + 1] is a response token to train on; `old_logprobs[n, t]` is
log π_old(tokens[n, t + 1] | tokens[n, ≤ t]); `old_values[n, t]` is the critic's value
of the prefix tokens[n, ≤ t]. The model reads `tokens` and is scored on
`labels` = tokens shifted left by one, so the last position has no label and
`loss_mask[:, -1]` must be 0. `pack_sequences` / `scatter_response` build this layout
from per-response lists and `gather_response` reads it back.

Padded micro-batches are rows of this batch, all of length S. Packed micro-batches
(`schedules.packing`) concatenate whole rows up to their `lengths` into one row of a token
budget; their model outputs come back in this [N, S] layout before any loss reads them.
How a mini-batch is split over DP ranks and micro-batches is `packing.Microbatching`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

Tensor = torch.Tensor

__all__ = ["TrainBatch", "epoch_order", "pack_sequences", "scatter_response", "gather_response"]

_TOKEN_FIELDS = (
    "old_logprobs",
    "ref_logprobs",
    "advantages",
    "returns",
    "old_values",
    "temperature",
    "h_hat",
    "is_weights",
)


@dataclass(frozen=True)
class TrainBatch:
    """One mini-batch (or one rank's slice of it); every tensor has N rows."""

    tokens: Tensor
    """[N, S] int64: prompt + response, right-padded with any valid id."""
    loss_mask: Tensor
    """[N, S] bool: position t predicts a response token (see the module docstring)."""
    old_logprobs: Optional[Tensor] = None
    """[N, S] float: log-probabilities of the behaviour policy (PPO ratio denominator)."""
    ref_logprobs: Optional[Tensor] = None
    """[N, S] float: reference-policy log-probabilities (KL penalty only)."""
    advantages: Optional[Tensor] = None
    """[N, S] float: per-token advantages (sequence advantages broadcast by the caller)."""
    returns: Optional[Tensor] = None
    """[N, S] float: critic targets."""
    old_values: Optional[Tensor] = None
    """[N, S] float: critic values at rollout time (value clipping)."""
    temperature: Optional[Tensor] = None
    """[N, S] float > 0: temperature token t + 1 was sampled at; None = 1."""
    h_hat: Optional[Tensor] = None
    """[N, S] float in [−1, 1]: HAPO normalised entropy (clip bounds, redistribution)."""
    is_weights: Optional[Tensor] = None
    """[N, S] float ≥ 0: rollout-correction weight of each token's policy loss; None = 1."""
    is_positive: Optional[Tensor] = None
    """[N] bool: the response was correct (VAPO positive-example NLL)."""
    routes: Optional[Tensor] = None
    """[N, S, layers, k] int16: MoE experts to replay for the token AT position t (input-
    aligned, unlike the fields above); -1 rows: the router's own choice. None: no replay."""
    lengths: Optional[Tensor] = None
    """[N] int64: real tokens of each row (prompt + response); the rest is padding. Packed
    micro-batches (schedules.packing) carry only these. None: every position is real."""

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2 or self.tokens.dtype != torch.long:
            raise ValueError(
                f"tokens must be a [N, S] int64 tensor, got {tuple(self.tokens.shape)} {self.tokens.dtype}"
            )
        shape = tuple(self.tokens.shape)
        for name in ("loss_mask", *_TOKEN_FIELDS):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"{name} must have the shape of tokens {shape}, got {tuple(value.shape)}")
        if self.routes is not None and (self.routes.dim() != 4 or tuple(self.routes.shape[:2]) != shape):
            raise ValueError(
                f"routes must be [N, S, layers, k] with [N, S] = {list(shape)}, got {tuple(self.routes.shape)}"
            )
        for name in ("is_positive", "lengths"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape[:1]:
                raise ValueError(f"{name} must be [N] = [{shape[0]}], got {tuple(value.shape)}")
        if (
            self.lengths is not None
            and shape[0]
            and not (0 < int(self.lengths.min()) and int(self.lengths.max()) <= shape[1])
        ):
            raise ValueError(
                f"lengths must lie in [1, S={shape[1]}], got [{int(self.lengths.min())}, {int(self.lengths.max())}]"
            )
        if shape[1] and bool(self.loss_mask[:, -1].bool().any()):
            raise ValueError("loss_mask[:, -1] must be 0: the last position has no next token")

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_length(self) -> int:
        return self.tokens.shape[1]

    @property
    def position_ids(self) -> Tensor:
        """[N, S]: 0 .. S-1 in every row."""
        return torch.arange(self.seq_length, device=self.tokens.device).expand_as(self.tokens)

    @property
    def row_batch(self) -> "TrainBatch":
        """The rows the losses read (a packed micro-batch answers with its sequences)."""
        return self

    def as_rows(self, x: Tensor) -> Tensor:
        """A model output in this micro-batch's layout, as [N, S, ...] rows: itself here."""
        return x

    def sequence_lengths(self) -> Tensor:
        """[N] int64 real tokens per row (S for every row when ``lengths`` is None)."""
        if self.lengths is not None:
            return self.lengths.long()
        return torch.full((self.num_rows,), self.seq_length, dtype=torch.long)

    @property
    def labels(self) -> Tensor:
        """tokens shifted left by one; the last column repeats the last token (never in the
        loss: loss_mask[:, -1] is 0) so that it stays a valid vocabulary id."""
        return torch.cat([self.tokens[:, 1:], self.tokens[:, -1:]], dim=1)

    def rows(self, start: int, stop: int) -> "TrainBatch":
        """Rows [start, stop) of every tensor."""
        return self._map(lambda x: x[start:stop])

    def select(self, index: Tensor) -> "TrainBatch":
        """The rows at ``index`` (a 1-D int64 tensor), in that order."""
        return self._map(lambda x: x.index_select(0, index.to(x.device)))

    def columns(self, stop: int) -> "TrainBatch":
        """Positions [0, stop) of every per-position tensor (rows with lengths <= stop)."""
        return self._map(lambda x: x[:, :stop] if x.dim() >= 2 else x)

    def to(self, device: torch.device) -> "TrainBatch":
        return self._map(lambda x: x.to(device, non_blocking=True))

    def require(self, *names: str) -> None:
        """Raise naming the fields a loss needs that this batch lacks."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"this loss needs batch fields {missing}; they are None")

    def _map(self, fn) -> "TrainBatch":
        changes = {
            f.name: fn(getattr(self, f.name)) for f in dataclasses.fields(self) if getattr(self, f.name) is not None
        }
        return dataclasses.replace(self, **changes)


def epoch_order(num_rows: int, seed: int, step: int, epoch: int) -> Tensor:
    """[num_rows] int64: a permutation of the rows for one PPO epoch's mini-batch split, drawn
    from its own generator seeded by (seed, step, epoch), so every rank draws the same one
    and a resumed run the one it would have drawn, whatever else used the global RNG."""
    generator = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1_009 + epoch) % 2**63)
    return torch.randperm(num_rows, generator=generator)


def pack_sequences(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    seq_length: int,
    pad_token_id: int = 0,
) -> tuple[Tensor, Tensor]:
    """(tokens [N, S], loss_mask [N, S]) for prompt + response rows, right-padded.

    A row longer than seq_length raises (truncating would silently drop the tokens the
    loss is about).
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    tokens = torch.full((len(prompts), seq_length), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((len(prompts), seq_length), dtype=torch.bool)
    for n, (prompt, response) in enumerate(zip(prompts, responses)):
        length = len(prompt) + len(response)
        if not prompt or length > seq_length:
            raise ValueError(
                f"row {n}: prompt {len(prompt)} + response {len(response)} tokens "
                f"must be non-empty and fit seq_length={seq_length}"
            )
        tokens[n, :length] = torch.tensor([*prompt, *response], dtype=torch.long)
        loss_mask[n, len(prompt) - 1 : length - 1] = True
    return tokens, loss_mask


def scatter_response(
    per_response: Sequence[Tensor],
    prompt_lengths: Sequence[int],
    seq_length: int,
    fill: float = 0.0,
) -> Tensor:
    """Place per-response-token values (e.g. vLLM logprobs, temperatures) into the
    prediction-aligned [N, S] layout: response token i of row n goes to position
    prompt_lengths[n] − 1 + i."""
    out = torch.full((len(per_response), seq_length), fill, dtype=torch.float32)
    for n, (values, prompt_len) in enumerate(zip(per_response, prompt_lengths)):
        values = torch.as_tensor(values, dtype=torch.float32)
        out[n, prompt_len - 1 : prompt_len - 1 + values.numel()] = values
    return out


def gather_response(x: Tensor, prompt_lengths: Sequence[int], response_lengths: Sequence[int]) -> list[Tensor]:
    """The inverse of `scatter_response`: row n's response-token values as a 1-D tensor."""
    return [x[n, p - 1 : p - 1 + r] for n, (p, r) in enumerate(zip(prompt_lengths, response_lengths))]
