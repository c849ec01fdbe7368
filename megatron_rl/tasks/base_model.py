"""Build the embedded default's supervised base: tokenizer + tiny HF model + warm-up.

No pretrained model is reachable here, and a random-init model almost never answers
correctly, so RL would get no signal. Like real pipelines, RL starts from a supervised
base: this one knows the answer format but is at chance on the task (see ``warmup``).
Everything is derived from :class:`BaseModelSettings` (seeded), and the result is cached
under the settings' content hash: a second call with the same settings returns at once.
The build runs on :data:`BUILD_THREADS` torch threads whatever the caller's thread count, so
every run that asks for the same settings gets the same weights, bit for bit.

Layout of the output directory: HF model (config.json, model.safetensors,
generation_config.json), tokenizer files with the chat template, ``train.jsonl`` /
``eval.jsonl`` prompt sets (fields ``prompt``, ``answer``) and ``tiny_base.json`` (the
settings, their hash and the measured report).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
import types
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol

from megatron_rl.models.hf_config import ModelArch, arch_from_hf
from megatron_rl.parallel.config import ModelShape
from megatron_rl.tasks.chat_format import training_text
from megatron_rl.tasks.digits import get_task

# Bump when the generated artefacts change for the same settings (invalidates caches).
BUILD_VERSION = 2
BUILD_THREADS = 1
"""torch's intra-op threads while a base is built, whatever the caller runs with. CPU kernels
split their work by the thread count and so round differently (the MoE experts' grouped GEMM
on an expert with few tokens, long reductions), and the warm-up's weights drifted with it: a
world-1 run builds on one thread per core, a rank of a torchrun launch of two or more on one
(torchrun sets OMP_NUM_THREADS=1). One, not two: on two idle cores the default base's
warm-up takes 2.9 s against 2.4 s, but with the cores shared (two test workers, two runs)
two threads wait on each other at every op, 56-82 s against 5-7 s."""
FAMILIES = ("qwen3_moe", "qwen2_moe", "qwen3")
TASK_BASE_SETTINGS: dict[str, dict[str, Any]] = {
    "digits_max_chain": {"warmup_correct_fraction": 0.25, "warmup_steps": 400},
    "digits_max_chain_cold": {"warmup_correct_fraction": 0.1, "warmup_steps": 400},
    "digits_max_uniform": {"warmup_correct_fraction": 0.25, "warmup_steps": 400},
}
"""Base settings a task's base differs in, where the defaults do not fit it. The chain task's
chains are up to 20 steps long, graded with the answer: after 60 warm-up steps not one held-out
chain of the base is well-formed, after 400 format-only steps 63 % are and 7 % right (chance
10 %), too few for RL to start from (DAPO's reward fell to 0.01-0.05 in 13 steps). A quarter
of true chains in the warm-up gives a start above chance that is far from the top
(docs/claims.md has the base's numbers). A tenth (``digits_max_chain_cold``) starts lower
still (greedy 0.28, sampled 0.11, 70 % well-formed), where PPO is far from done at step 100.
``digits_max_uniform`` (the reward-model examples) warms up on a quarter of true answers too:
after the default format-only warm-up its held-out accuracy is chance (0.10), and GRPO on
the rule at lr 1e-3 was still at a reward of 0.05-0.09 after 12 steps."""
REPORT_FILE = "tiny_base.json"
HELD_OUT_FILE = "eval.jsonl"
"""The held-out prompts: none of them is in train.jsonl, the prompts RL training draws."""
BASE_CACHE_ENV = "MEGATRON_RL_BASE_CACHE"
"""A directory for task bases shared by runs: each base is built once, under its settings'
content hash, and reused by every run that asks for the same settings. The build is
deterministic and runs on a fixed torch thread count whatever the rank's own
(BUILD_THREADS), so a cached base is the base the run would have built, at any world size.
Named here, below the trainer, so that a harness launching runs sets it without torch."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BaseModelSettings:
    """Everything that determines the base model; its hash names the cache entry."""

    task: str = "digits_max"
    """Synthetic task (``megatron_rl.tasks.TASKS``)."""
    family: str = "qwen3_moe"
    """HF model family: qwen3_moe, qwen2_moe (MoE) or qwen3 (dense)."""
    hidden_size: int = 128
    num_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    """vLLM's CPU attention accepts 32, 64, 80, ... (16 fails)."""
    intermediate_size: int = 256
    """Dense FFN width (qwen3), shared-expert width (qwen2_moe)."""
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    tokenizer_vocab_size: int = 320
    """BPE target size (256 bytes + specials + merges the corpus supports)."""
    vocab_multiple: int = 64
    """The model's vocabulary is the tokenizer's rounded up to this (divisible by TP)."""
    max_position_embeddings: int = 256
    seed: int = 0
    num_train_prompts: int = 4000
    """Prompts for the warm-up, the tokenizer corpus and ``train.jsonl``."""
    num_eval_prompts: int = 256
    """Held-out prompts (none of them in the train set) for ``eval.jsonl`` and the report."""
    warmup_steps: int = 60
    warmup_batch_size: int = 32
    warmup_lr: float = 3e-3
    warmup_correct_fraction: float = 0.0
    """Share of warm-up examples with the true answer (0: format only, chance accuracy)."""

    def __post_init__(self) -> None:
        get_task(self.task)
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r} is not supported; allowed: {list(FAMILIES)}")
        if self.head_dim < 32:
            raise ValueError(f"head_dim={self.head_dim}: vLLM's CPU attention needs >= 32")
        if not 0.0 <= self.warmup_correct_fraction <= 1.0:
            raise ValueError(f"warmup_correct_fraction={self.warmup_correct_fraction} is not in [0, 1]")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} > num_experts={self.num_experts}")

    @classmethod
    def from_arch(cls, arch: ModelArch, **settings: Any) -> BaseModelSettings:
        """The base of architecture ``arch`` (a model preset), ``settings`` for the rest (task,
        seed, ...). ``arch.vocab_size`` is the tokenizer's target. Raises ValueError for an
        architecture a base cannot have: one whose HF fields would not read back as ``arch``."""
        fields = dict(
            family=arch.family,
            hidden_size=arch.hidden_size,
            num_layers=arch.num_layers,
            num_attention_heads=arch.num_attention_heads,
            num_key_value_heads=arch.num_query_groups,
            head_dim=arch.head_dim,
            intermediate_size=arch.ffn_hidden_size,
            tokenizer_vocab_size=arch.vocab_size,
            max_position_embeddings=arch.max_position_embeddings,
        )
        if arch.is_moe:
            fields.update(
                num_experts=arch.num_moe_experts,
                num_experts_per_tok=arch.moe_router_topk,
                moe_intermediate_size=arch.moe_ffn_hidden_size,
            )
        base = cls(**fields, **settings)
        built = arch_from_hf(types.SimpleNamespace(**base.hf_fields(base.tokenizer_vocab_size)))
        differ = [f.name for f in dataclasses.fields(arch) if getattr(arch, f.name) != getattr(built, f.name)]
        if differ:
            raise ValueError(f"a task base cannot have this architecture; it would differ in {', '.join(differ)}")
        return base

    def hf_fields(self, vocab_size: int, *, eos_id: Optional[int] = None, pad_id: Optional[int] = None) -> dict:
        """The HF config fields (``model_type`` included) of this base: the one table behind
        both the saved config.json and :meth:`model_shape`, so the two cannot disagree."""
        fields = dict(
            model_type=self.family,
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            bos_token_id=None,
        )
        if self.family != "qwen3":
            fields.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=True,
            )
        if self.family == "qwen2_moe":
            fields.update(shared_expert_intermediate_size=self.intermediate_size)
        return fields

    def model_shape(self) -> ModelShape:
        """What a parallel layout must divide, known before the base is built (the vocabulary,
        which needs the trained tokenizer, is not among it): read through the same HF mapping
        the trainer applies to the built config.json."""
        fields = self.hf_fields(self.tokenizer_vocab_size)
        return arch_from_hf(types.SimpleNamespace(**fields)).shape()

    def content_hash(self) -> str:
        return settings_hash(self, "build", BUILD_VERSION)

    def build(self, out: Path) -> dict[str, Any]:
        """Build the base into the empty directory ``out``; returns the report."""
        return _build(self, out)


def hf_config(settings: BaseModelSettings, vocab_size: int, eos_id: int, pad_id: int):
    """The transformers config of the chosen family."""
    from transformers import AutoConfig

    fields = settings.hf_fields(vocab_size, eos_id=eos_id, pad_id=pad_id)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def split_prompts(settings: BaseModelSettings):
    """Train prompts and held-out eval prompts (no eval prompt text occurs in train)."""
    task = get_task(settings.task)
    train = task.generate(settings.num_train_prompts, seed=settings.seed)
    seen = {e.prompt for e in train}
    held_out = [e for e in task.generate(settings.num_eval_prompts * 4, seed=settings.seed + 1) if e.prompt not in seen]
    if len(held_out) < settings.num_eval_prompts:
        raise ValueError(
            f"task {settings.task!r} has too few distinct prompts for "
            f"{settings.num_eval_prompts} held-out ones beside the train set"
        )
    return task, train, held_out[: settings.num_eval_prompts]


def _write_jsonl(path: Path, task, examples) -> None:
    """The prompt file of ``examples``: the prompt, and what the task's verifier scores against."""
    with path.open("w") as f:
        for e in examples:
            f.write(json.dumps({"prompt": e.prompt, "answer": task.reference(e)}) + "\n")


def warm_up(model, encoded, settings: BaseModelSettings, pad_id: int) -> list[float]:
    """The supervised warm-up of a task base, with the settings' steps, batch, lr and seed."""
    from megatron_rl.tasks.warmup import supervised_warmup

    return supervised_warmup(
        model,
        encoded,
        steps=settings.warmup_steps,
        batch_size=settings.warmup_batch_size,
        lr=settings.warmup_lr,
        seed=settings.seed,
        pad_id=pad_id,
    )


def save_base(model, tokenizer, out: Path) -> None:
    """Model and tokenizer as one HF directory that vLLM, transformers and the trainer load
    alike; greedy by default, with the tokenizer's eos and pad."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def _build(settings: BaseModelSettings, out: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_rl.tasks.tokenizer import train_tokenizer
    from megatron_rl.tasks.warmup import accuracy, encode_warmup

    started, cpu_started = time.perf_counter(), time.process_time()
    task, train, held_out = split_prompts(settings)
    tokenizer = train_tokenizer(["".join(training_text(e)) for e in train], settings.tokenizer_vocab_size)
    vocab = -(-len(tokenizer) // settings.vocab_multiple) * settings.vocab_multiple
    config = hf_config(settings, vocab, tokenizer.eos_token_id, tokenizer.pad_token_id)

    torch.manual_seed(settings.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    max_new_tokens = max(len(tokenizer(training_text(e)[1], add_special_tokens=False).input_ids) for e in train) + 2
    encoded = encode_warmup(tokenizer, task, train, settings.seed, settings.warmup_correct_fraction)
    losses = warm_up(model, encoded, settings, tokenizer.pad_token_id)
    warmup_seconds = time.perf_counter() - started
    greedy = accuracy(model, tokenizer, task, held_out, max_new_tokens)
    sampled = accuracy(model, tokenizer, task, held_out, max_new_tokens, sample=True, seed=settings.seed)
    majority = Counter(e.answer for e in held_out).most_common(1)[0][1] / len(held_out)

    save_base(model, tokenizer, out)
    _write_jsonl(out / "train.jsonl", task, train)
    _write_jsonl(out / HELD_OUT_FILE, task, held_out)
    return {
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": vocab,
        "tokenizer_size": len(tokenizer),
        "max_new_tokens": max_new_tokens,
        "chance_accuracy": task.chance_accuracy,
        "majority_answer_accuracy": majority,
        "accuracy_after_warmup": greedy["accuracy"],
        "format_rate_after_warmup": greedy["format_rate"],
        "sampled_accuracy_after_warmup": sampled["accuracy"],
        "sampled_format_rate_after_warmup": sampled["format_rate"],
        "greedy_responses": greedy["responses"][:4],
        "sampled_responses": sampled["responses"][:4],
        "warmup_first_loss": losses[0],
        "warmup_final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "warmup_seconds": warmup_seconds,
        "seconds": time.perf_counter() - started,
        "cpu_seconds": time.process_time() - cpu_started,  # wall time varies with machine load
        "torch_threads": torch.get_num_threads(),
    }


def read_report(directory: Path | str) -> Optional[dict[str, Any]]:
    path = Path(directory) / REPORT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


class BaseBuild(Protocol):
    """What :func:`make_tiny_base` builds from: a frozen dataclass (saved in the report) that
    names its cache entry and builds into a directory. :class:`BaseModelSettings` for a digit
    task, ``tasks.gym_base.GymBaseSettings`` for a reasoning-gym dataset."""

    def content_hash(self) -> str: ...

    def build(self, out: Path) -> dict[str, Any]: ...


def settings_hash(settings: Any, build_key: str, build_version: int) -> str:
    """16 hex digits naming a base's cache entry: its settings (a dataclass) and the version of
    the code that builds it, under a key of its own per kind of base."""
    payload = json.dumps({build_key: build_version, **dataclasses.asdict(settings)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def make_tiny_base(
    directory: Path | str, settings: BaseBuild = BaseModelSettings(), *, verbose: bool = True
) -> dict[str, Any]:
    """Build (or reuse) the base model in ``directory``; returns the report dict.

    The report has ``chance_accuracy``, ``accuracy_after_warmup`` (greedy, held-out),
    ``seconds`` (of the build that made it) and ``cached`` (True when reused). The build runs
    under :func:`build_threads`: its artefacts do not depend on the caller's thread count.
    """
    directory = Path(directory)
    digest = settings.content_hash()
    directory.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(directory):
        existing = read_report(directory)
        if existing and existing.get("settings_hash") == digest:
            report = {**existing["report"], "cached": True, "directory": str(directory)}
        else:
            report = {**_build_into(directory, settings, digest), "cached": False, "directory": str(directory)}
    if verbose:
        print(format_report(report), flush=True)
    return report


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """Held while ``directory`` is checked and built: two processes asking for the same base
    (two runs sharing a base cache, see from_config.setup) build it once, the second waits and
    reuses it. An advisory lock on a file beside the directory, released when the holder
    exits, however it ends."""
    with open(directory.parent / f".{directory.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def build_threads(threads: int) -> Iterator[None]:
    """torch on ``threads`` intra-op threads inside, the caller's count restored after."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _build_into(directory: Path, settings: BaseBuild, digest: str) -> dict[str, Any]:
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the run directory is not
    try:
        with build_threads(BUILD_THREADS):
            report = settings.build(staging)
        (staging / REPORT_FILE).write_text(
            json.dumps({"settings_hash": digest, "settings": dataclasses.asdict(settings), "report": report}, indent=2)
        )
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(staging, directory)  # readers never see a half-written directory
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return report


def format_report(report: dict[str, Any]) -> str:
    return (
        f"tiny base in {report['directory']}{' (cached)' if report['cached'] else ''}: "
        f"{report['num_parameters'] / 1e6:.2f} M params, chance accuracy "
        f"{report['chance_accuracy']:.3f} (majority answer {report['majority_answer_accuracy']:.3f}), "
        f"greedy accuracy after warm-up {report['accuracy_after_warmup']:.3f} "
        f"(well-formed {report['format_rate_after_warmup']:.3f}), sampled (T=1) accuracy "
        f"{report['sampled_accuracy_after_warmup']:.3f} (well-formed "
        f"{report['sampled_format_rate_after_warmup']:.3f}), built in {report['seconds']:.1f} s "
        f"({report['cpu_seconds']:.1f} s CPU)"
    )


def main(argv: list[str]) -> int:
    """``make-tiny-base`` command: build (or reuse) the base and print its report."""
    import argparse
    import subprocess
    import sys

    defaults = BaseModelSettings()
    parser = argparse.ArgumentParser(prog="make_tiny_base", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for the model, tokenizer and prompts")
    for field in dataclasses.fields(BaseModelSettings):
        parser.add_argument(
            f"--{field.name.replace('_', '-')}",
            type=type(getattr(defaults, field.name)),
            default=getattr(defaults, field.name),
        )
    parser.add_argument(
        "--check-vllm",
        action="store_true",
        help="also load the result in vLLM and compare greedy answers with transformers",
    )
    args = vars(parser.parse_args(argv))
    out, check = args.pop("out"), args.pop("check_vllm")
    try:
        settings = BaseModelSettings(**args)
    except ValueError as exc:
        parser.error(str(exc))
    make_tiny_base(out, settings)
    if check:
        result = subprocess.run(
            [sys.executable, "-m", "megatron_rl.tasks.engine_check", str(out)], capture_output=True, text=True
        )
        line = next((out for out in result.stdout.splitlines() if out.startswith("ENGINE_CHECK ")), None)
        if line is None:
            print(result.stderr[-4000:], file=sys.stderr)
            return 1
        check_result = json.loads(line.split(" ", 1)[1])
        agree = check_result["vllm"] == check_result["transformers"]
        print(
            f"vLLM greedy == transformers greedy: {agree}; max |logprob diff| "
            f"{check_result['max_logprob_abs_diff']}; vLLM engine build {check_result['vllm_build_s']:.1f} s"
        )
        return 0 if agree else 1
    return 0
