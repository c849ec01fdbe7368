"""reasoning-gym datasets as prompt data: ``data.source: reasoning_gym:<dataset>``.

A :class:`GymSpec` (dataset name, its constructor options, seed, size) fixes a training set:
reasoning-gym generates entry ``i`` from ``(seed, i)`` alone, so the same spec gives the same
questions on every rank, in every reward worker and after a resume.

How a prompt is asked and answered:

- The user message is the entry's question followed by :data:`ANSWER_INSTRUCTION`, which
  asks for the final answer between ``<answer>`` and ``</answer>``: reasoning-gym's own
  convention (its system prompts ask for it), read back with its own extractor
  (``reasoning_gym.utils.extract_answer``). The instruction sits in the user message rather
  than a system message because not every chat template has a system role.
- The prompt's answer field is a *reference* (:func:`reference`): the spec and the entry's
  index as JSON. The reward worker rebuilds the entry from it and calls the dataset's own
  ``score_answer(extracted, entry)``; entries themselves may hold metadata that JSON cannot
  carry (tuples, sets), so they never travel.

reasoning-gym is imported only when a spec is checked or used (it takes seconds to import),
so other config errors stay fast.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
from typing import Any, Collection, Mapping, Optional, Sequence

from megatron_rl.data.prompts import PromptRecord, encode_prompt

SOURCE_PREFIX = "reasoning_gym:"
ANSWER_INSTRUCTION = "Give only the final answer between <answer> and </answer> tags."
SPEC_KEYS = ("seed", "size")
"""Fields of every reasoning-gym dataset config that the spec sets (``data.seed``,
``data.size``), never ``data.options``."""
HELD_OUT_DRAWS = 8
"""A held-out set draws up to this many times its size before giving up on finding enough
questions outside the training set."""


@dataclasses.dataclass(frozen=True)
class GymSpec:
    """One reasoning-gym dataset: ``reasoning_gym.create_dataset(dataset, **options, seed=seed,
    size=size)``; entries ``0 .. size-1`` are the set."""

    dataset: str
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    seed: int = 0
    size: int = 1000

    def to_json(self) -> dict:
        return {"dataset": self.dataset, "options": dict(self.options), "seed": self.seed, "size": self.size}


def _datasets() -> dict:
    from reasoning_gym.factory import DATASETS  # the registry create_dataset reads

    return DATASETS


def list_datasets() -> list[str]:
    """Every dataset name reasoning-gym registers."""
    return sorted(_datasets())


def check_spec(spec: GymSpec) -> None:
    """Raise ValueError (one line) for an unknown dataset, an option its config does not have,
    or values reasoning-gym's own validation rejects; also generates entry 0."""
    datasets = _datasets()
    if spec.dataset not in datasets:
        close = difflib.get_close_matches(spec.dataset, datasets, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ValueError(
            f"reasoning-gym has no dataset {spec.dataset!r}; {hint}{len(datasets)} exist, e.g. "
            f"{', '.join(sorted(datasets)[:6])}; python -c 'import reasoning_gym.factory as f; "
            "print(sorted(f.DATASETS))' lists them"
        )
    if spec.size < 1:
        raise ValueError(f"size={spec.size} must be >= 1")
    _, config_cls = datasets[spec.dataset]
    allowed = sorted(f.name for f in dataclasses.fields(config_cls) if f.name not in SPEC_KEYS)
    for key in spec.options:
        if key in SPEC_KEYS:
            raise ValueError(f"option {key!r} is set by data.{key}, not data.options")
        if key not in allowed:
            raise ValueError(f"{spec.dataset} has no option {key!r}; allowed: {allowed}")
    try:
        build_dataset(spec)[0]
    except Exception as err:  # reasoning-gym validates with asserts; bad types fail anywhere inside
        reason = " ".join(str(err).split()) or type(err).__name__  # one line, as every config error
        raise ValueError(f"reasoning-gym rejects {spec.dataset} options {dict(spec.options)}: {reason}") from None


@functools.lru_cache(maxsize=16)
def _cached_dataset(dataset: str, options_json: str, seed: int, size: int):
    import reasoning_gym

    return reasoning_gym.create_dataset(dataset, **json.loads(options_json), seed=seed, size=size)


def build_dataset(spec: GymSpec):
    """The reasoning-gym dataset object of ``spec`` (cached per spec in this process)."""
    return _cached_dataset(spec.dataset, json.dumps(dict(spec.options), sort_keys=True), spec.seed, spec.size)


def user_message(question: str) -> str:
    return f"{question}\n{ANSWER_INSTRUCTION}"


def prompt_ids(tokenizer, question: str) -> tuple[int, ...]:
    """The chat-templated ids of a question's prompt (one user message)."""
    return tuple(encode_prompt(tokenizer, [{"role": "user", "content": user_message(question)}]))


def extract_answer(response: str) -> Optional[str]:
    """The content of the last ``<answer>...</answer>`` (reasoning-gym's extractor); None if absent."""
    from reasoning_gym.utils import extract_answer as gym_extract

    return gym_extract(response)


def reference(spec: GymSpec, index: int, answer: str) -> str:
    """What a prompt carries as its answer: the spec and index that rebuild the entry, and the
    entry's answer (for a person reading rollouts, and to catch a regenerated entry that differs)."""
    return json.dumps({**spec.to_json(), "index": index, "answer": answer}, sort_keys=True)


def resolve(ref: str) -> tuple[Any, dict]:
    """``(dataset object, entry)`` of a :func:`reference`."""
    fields = json.loads(ref)
    spec = GymSpec(fields["dataset"], fields["options"], fields["seed"], fields["size"])
    dataset = build_dataset(spec)
    entry = dataset[fields["index"]]
    if str(entry["answer"]) != fields["answer"]:
        raise ValueError(f"{spec.dataset}[{fields['index']}] regenerated with another answer: not deterministic here")
    return dataset, entry


class GymPrompts:
    """The training set of a spec as prompt records (chat-templated ids, reference answers),
    indexable and sized like :class:`megatron_rl.data.PromptDataset`."""

    def __init__(self, spec: GymSpec, tokenizer, indices: Optional[Sequence[int]] = None):
        dataset = build_dataset(spec)
        self.spec = spec
        self.records = []
        for i in range(spec.size) if indices is None else indices:
            entry = dataset[i]
            ids = prompt_ids(tokenizer, entry["question"])
            self.records.append(PromptRecord(ids, reference(spec, i, str(entry["answer"])), f"{spec.dataset}[{i}]"))

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> PromptRecord:
        return self.records[index]


def held_out_indices(train: GymSpec, seed: int, size: int) -> tuple[GymSpec, list[int]]:
    """A held-out set of ``size`` entries of ``train``'s dataset and options under ``seed``, none
    of whose questions occur in the training set (nor twice in the held-out set).

    A different seed alone is not enough: reasoning-gym draws entry ``i`` from a generator
    seeded with ``seed + i``, so seeds ``s`` and ``s + 1`` share all but one entry, and small
    option ranges repeat questions anyway (count_bits up to 15 has 15). The questions of the
    training set are filtered out; a seed of at least ``train.seed + train.size`` avoids the
    shared entries. Returns the spec to generate from (its size covers the indices) and the
    indices; raises ValueError when the dataset has too few questions beside the training set.
    """
    if seed == train.seed:
        raise ValueError(f"held-out seed {seed} is the training seed: pick another")
    seen = {entry["question"] for entry in build_dataset(train)}
    # Enough draws to step over the whole training range of generator seeds, then some.
    spec = GymSpec(train.dataset, train.options, seed, train.size + size * HELD_OUT_DRAWS)
    dataset, picked = build_dataset(spec), []
    for i in range(spec.size):
        question = dataset[i]["question"]
        if question not in seen:
            seen.add(question)
            picked.append(i)
            if len(picked) == size:
                return spec, picked
    raise ValueError(
        f"{train.dataset} with options {dict(train.options)} gave only {len(picked)} questions outside "
        f"the {train.size}-entry training set in {spec.size} draws; {size} were asked for"
    )


def held_out_prompts(train: GymSpec, seed: int, size: int, tokenizer) -> GymPrompts:
    """:func:`held_out_indices` as prompt records, scored like the training prompts."""
    spec, indices = held_out_indices(train, seed, size)
    return GymPrompts(spec, tokenizer, indices)


def eval_prompts(spec: GymSpec, tokenizer, training: Collection[tuple[int, ...]]) -> GymPrompts:
    """An eval set of ``spec.size`` prompts of ``spec``'s dataset, options and seed: its first
    entries whose question is not a training prompt (``training``: their prompt ids) nor
    one already picked, among ``HELD_OUT_DRAWS`` times that many (the references name that
    larger spec). Raises ValueError when the dataset has too few such questions."""
    draws = dataclasses.replace(spec, size=spec.size * HELD_OUT_DRAWS)
    dataset, picked, seen = build_dataset(draws), [], set()
    for i in range(draws.size):
        question = dataset[i]["question"]
        if question in seen:
            continue
        seen.add(question)
        if prompt_ids(tokenizer, question) not in training:
            picked.append(i)
            if len(picked) == spec.size:
                return GymPrompts(draws, tokenizer, picked)
    raise ValueError(
        f"{spec.dataset} with options {dict(spec.options)} and seed {spec.seed} gave only {len(picked)} "
        f"questions that are not training prompts in {draws.size} draws; {spec.size} were asked for"
    )
