"""Row-piece algebra: how each Megatron tensor is made of rows of HF tensors.

Every relation the bridge needs (plain copy, vocabulary padding, gate/up fusion, per-group
QKV interleaving, per-expert <-> stacked expert layouts) moves whole rows (dim 0) and
keeps the other dims as they are. So one relation is a list of :class:`Piece` s, "rows
[a, b) of Megatron tensor M are rows [c, d) of HF tensor H (at leading index e)", and the
same list drives both directions: loading reads only the HF rows a shard needs, exporting
assembles each HF tensor from full Megatron tensors. Megatron rows that no piece covers
are vocabulary padding: zero on load, dropped on export.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from megatron_rl.models.hf_config import ModelArch


class BridgeError(ValueError):
    """A checkpoint or model that does not fit the HF <-> Megatron mapping."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows ``rows`` of Megatron tensor ``megatron`` == rows ``hf_rows`` of ``hf[hf_lead]``."""

    megatron: str
    rows: tuple[int, int]
    hf: str
    hf_lead: tuple[int, ...]
    hf_rows: tuple[int, int]


def dims_of(arch: ModelArch, padded_vocab: int) -> dict[str, int]:
    """The size symbols the family tables use, for one architecture."""
    dims = dict(
        hidden=arch.hidden_size,
        vocab=arch.vocab_size,
        padded_vocab=padded_vocab,
        head_dim=arch.head_dim,
        heads=arch.num_attention_heads,
        groups=arch.num_query_groups,
        q_rows=arch.num_attention_heads * arch.head_dim,
        kv_rows=arch.num_query_groups * arch.head_dim,
        ffn=arch.ffn_hidden_size,
        one=1,
    )
    if arch.is_moe:
        dims.update(
            experts=arch.num_moe_experts,
            moe_ffn=arch.moe_ffn_hidden_size,
            moe_fc1=2 * arch.moe_ffn_hidden_size,
            shared_ffn=arch.moe_shared_expert_intermediate_size or 0,
        )
    return dims


# ---- the relations (one per way rows move); each returns (megatron rows, pieces)


@dataclasses.dataclass(frozen=True)
class Copy:
    """The HF tensor is the Megatron tensor."""

    rows: str

    def pieces(self, m: str, hf: Sequence[str], dims, lead=()) -> tuple[int, list[Piece]]:
        (h,) = hf
        n = dims[self.rows]
        return n, [Piece(m, (0, n), h, lead, (0, n))]

    def hf_rows(self, dims, count) -> list[int]:
        return [dims[self.rows]]


@dataclasses.dataclass(frozen=True)
class PadRows:
    """Vocabulary rows: Megatron pads the row count up for TP; the padding has no HF rows."""

    rows: str = "vocab"
    padded: str = "padded_vocab"

    def pieces(self, m, hf, dims, lead=()):
        (h,) = hf
        n = dims[self.rows]
        return dims[self.padded], [Piece(m, (0, n), h, lead, (0, n))]

    def hf_rows(self, dims, count) -> list[int]:
        return [dims[self.rows]]


@dataclasses.dataclass(frozen=True)
class Concat:
    """Megatron stacks the HF tensors along rows (gated MLP: linear_fc1 = [gate; up])."""

    rows: str

    def pieces(self, m, hf, dims, lead=()):
        n = dims[self.rows]
        return n * len(hf), [Piece(m, (i * n, (i + 1) * n), h, lead, (0, n)) for i, h in enumerate(hf)]

    def hf_rows(self, dims, count) -> list[int]:
        return [dims[self.rows]] * count


@dataclasses.dataclass(frozen=True)
class GroupedQKV:
    """Megatron's linear_qkv rows are per query group: [q heads of g, k_g, v_g] for each g,
    so that a TP rank's contiguous row block holds whole groups."""

    def pieces(self, m, hf, dims, lead=()):
        q, k, v = hf
        d, groups = dims["head_dim"], dims["groups"]
        q_per_group = dims["heads"] // groups * d
        block = q_per_group + 2 * d
        out = []
        for g in range(groups):
            start = g * block
            out += [
                Piece(m, (start, start + q_per_group), q, lead, (g * q_per_group, (g + 1) * q_per_group)),
                Piece(m, (start + q_per_group, start + q_per_group + d), k, lead, (g * d, (g + 1) * d)),
                Piece(m, (start + q_per_group + d, start + block), v, lead, (g * d, (g + 1) * d)),
            ]
        return groups * block, out

    def hf_rows(self, dims, count) -> list[int]:
        return [dims["q_rows"], dims["kv_rows"], dims["kv_rows"]]


@dataclasses.dataclass(frozen=True)
class Rule:
    """One Megatron tensor template and the HF tensor template(s) it is made of.

    Templates use ``{layer}`` and ``{expert}``. When the HF templates lack ``{expert}``
    while the Megatron one has it, the HF tensor stacks all experts on a leading axis
    (transformers-5 fused experts) and the expert index becomes that axis.
    """

    megatron: str
    hf: tuple[str, ...]
    relation: object
    cols: tuple[str, ...] = ()
    """Size symbols of the dims after the first (the same on both sides)."""
    when: str = ""
    """Name of a :class:`Conditions` flag; the rule applies only when it is true."""


@dataclasses.dataclass(frozen=True)
class Conditions:
    """Architecture flags that switch optional rules on."""

    qkv_bias: bool
    qk_layernorm: bool
    untied: bool
    shared_expert: bool

    @classmethod
    def of(cls, arch: ModelArch) -> "Conditions":
        return cls(
            qkv_bias=arch.qkv_bias,
            qk_layernorm=arch.qk_layernorm,
            untied=not arch.tie_word_embeddings,
            shared_expert=bool(arch.moe_shared_expert_intermediate_size),
        )


@dataclasses.dataclass
class TensorMap:
    """The expanded mapping of one model: shapes of both sides and the pieces between."""

    megatron_shapes: dict[str, tuple[int, ...]]
    hf_shapes: dict[str, tuple[int, ...]]
    pieces_of_megatron: dict[str, list[Piece]]
    pieces_of_hf: dict[str, list[Piece]]

    def hf_names(self) -> list[str]:
        return list(self.hf_shapes)


def expand(rules: Sequence[Rule], arch: ModelArch, padded_vocab: int) -> TensorMap:
    """Instantiate ``rules`` for every layer (and expert) of ``arch``."""
    dims = dims_of(arch, padded_vocab)
    flags = Conditions.of(arch)
    out = TensorMap({}, {}, {}, {})
    experts = range(arch.num_moe_experts or 0)
    for rule in rules:
        if rule.when and not getattr(flags, rule.when):
            continue
        layers = range(arch.num_layers) if "{layer}" in rule.megatron else [None]
        for layer in layers:
            per_expert = "{expert}" in rule.megatron
            for expert in experts if per_expert else [None]:
                _add(out, rule, dims, layer, expert)
    return out


def _add(out: TensorMap, rule: Rule, dims: Mapping[str, int], layer, expert) -> None:
    fill = {"layer": layer, "expert": expert}
    m = rule.megatron.format(**fill)
    hf = tuple(h.format(**fill) for h in rule.hf)
    stacked = expert is not None and not any("{expert}" in h for h in rule.hf)
    lead = (expert,) if stacked else ()
    rows, pieces = rule.relation.pieces(m, hf, dims, lead)
    cols = tuple(dims[c] for c in rule.cols)
    out.megatron_shapes[m] = (rows, *cols)
    out.pieces_of_megatron[m] = pieces
    for h, hf_rows in zip(hf, rule.relation.hf_rows(dims, len(hf))):
        out.hf_shapes[h] = ((dims["experts"],) if stacked else ()) + (hf_rows, *cols)
    for piece in pieces:
        out.pieces_of_hf.setdefault(piece.hf, []).append(piece)
