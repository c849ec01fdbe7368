"""The eval phase: between two steps, the job's own vLLM engines sample every eval prompt
``eval.n_samples`` times with the current weights, the run's reward scores the samples,
and the set's ``val/<set>/...`` metrics and per-prompt records come back.

It leaves training as it was (a run with eval on trains exactly as with it off):
- its prompts are sets of their own (the task's held-out split, a file), never the
  training loader's, whose cursor it does not touch; a set sharing a prompt with the
  training data is refused;
- every sample has its own seed (from eval.seed, the set, the prompt and the sample), and
  every random generator of the process (torch, python, numpy, Megatron's tracker) is put
  back as it was afterwards, since vLLM's CPU sampler also draws from torch's global one;
- the engines' prefix cache is dropped afterwards, as after a weight sync, so the next
  rollout finds the cache it would have found without eval.

Each replica (engines of W / engine-TP ranks) generates and scores a contiguous share of a
set's prompts; every rank gets every prompt's result, and one rank writes them.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import torch.distributed as dist

from megatron_rl.config.schema import Config, EvalConfig
from megatron_rl.evaluation.metrics import PromptResult, set_metrics
from megatron_rl.evaluation.sets import EvalSet
from megatron_rl.rollout.engine import RolloutEngine, Sampling
from megatron_rl.rollout.seeds import MAX_SAMPLES

Score = Callable[[list[str], list[str]], tuple[list[float], dict]]
Decode = Callable[[list[int]], str]


def eval_sampling(cfg: Config, eos_token_id: int) -> Sampling:
    """How every eval sample is drawn: n = eval.n_samples, the eval budget (rollout's when
    unset), temperature and top_p; no logprobs."""
    ev = cfg.eval
    return Sampling(
        n=ev.n_samples,
        max_tokens=ev.max_new_tokens or cfg.rollout.max_new_tokens,
        temperature=ev.temperature,
        top_p=ev.top_p,
        stop_token_ids=(eos_token_id,),
        logprobs=False,
    )


def sample_seed(seed: int, set_name: str, prompt_id: int) -> int:
    """The seed of a prompt's first sample (vLLM seeds sample i with this + i), apart from
    the training prompts' seeds (rollout.seeds), a multiple of MAX_SAMPLES."""
    digest = hashlib.blake2b(f"eval/{seed}/{set_name}/{prompt_id}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") % (1 << 40)) * MAX_SAMPLES


class Evaluator:
    """Evaluates the engines' current weights on every set; :meth:`evaluate` on every rank."""

    def __init__(
        self,
        config: EvalConfig,
        sets: Sequence[EvalSet],
        engine: RolloutEngine,
        scores: Mapping[str, Score],
        decode: Decode,
        sampling: Sampling,
        out_dir: Path,
        write: bool,
        records_name: Optional[str] = None,
    ):
        self.config = config
        self.sets = list(sets)
        self.engine = engine
        self.scores = dict(scores)
        """Reward name -> its verifier's score_batch; every set's reward is among them."""
        missing = sorted({s.reward for s in self.sets} - self.scores.keys())
        if missing:
            raise ValueError(f"no scorer for the eval sets' rewards {missing}")
        self.decode = decode
        self.sampling = sampling
        """n = eval.n_samples, the eval budget and temperature; no logprobs."""
        self.out_dir = Path(out_dir)
        """Where ``step_<N>.jsonl`` goes (RUN_DIR/eval)."""
        self.write = write
        self.records_name = records_name
        """The per-prompt file's name (None: ``step_<N>.jsonl``, the run's)."""

    def evaluate(self, step: int) -> dict[str, float]:
        """The val/<set>/... metrics of the current weights and timing/eval_s; writes
        ``step_<step>.jsonl`` (one line per prompt of every set)."""
        from megatron_rl.checkpoint import rng

        started = time.perf_counter()
        saved = rng.capture()
        try:
            results = {s.name: self._evaluate_set(s) for s in self.sets}
        finally:
            rng.restore(saved)
            self.engine.finish_weight_update()  # drops the prefixes eval cached
        metrics: dict[str, float] = {}
        for name, per_prompt in results.items():
            metrics.update(set_metrics(name, per_prompt, self.config.pass_k))
        if self.write:
            self._write(step, results)
        metrics["timing/eval_s"] = time.perf_counter() - started
        return metrics

    def _evaluate_set(self, eval_set: EvalSet) -> list[PromptResult]:
        """Every prompt's result, in the set's order, the same list on every rank."""
        engine = self.engine
        per_replica = -(-len(eval_set) // engine.num_replicas)
        mine = list(range(engine.replica * per_replica, min(len(eval_set), (engine.replica + 1) * per_replica)))
        local: list[PromptResult] = []
        if mine:
            seeds = [sample_seed(self.config.seed, eval_set.name, i) for i in mine]
            groups = engine.generate([list(eval_set.prompt_ids[i]) for i in mine], self.sampling, seeds)
            texts = [self.decode(s.token_ids) for group in groups for s in group]
            answers = [eval_set.answers[i] for i, group in zip(mine, groups) for _ in group]
            scores, _ = self.scores[eval_set.reward](texts, answers)
            cursor = 0
            for i, group in zip(mine, groups):
                local.append(
                    PromptResult.from_samples(
                        i,
                        scores[cursor : cursor + len(group)],
                        [len(s.token_ids) for s in group],
                        truncated=sum(s.finish_reason == "length" for s in group),
                    )
                )
                cursor += len(group)
        leader = dist.get_rank() % engine.tp == 0  # one rank per replica reports its share
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local if leader else None)
        results = sorted((r for share in everyone if share for r in share), key=lambda r: r.prompt_id)
        if [r.prompt_id for r in results] != list(range(len(eval_set))):
            raise RuntimeError(f"eval set {eval_set.name!r}: the replicas returned {len(results)} of {len(eval_set)}")
        return results

    def _write(self, step: int, results: dict[str, list[PromptResult]]) -> None:
        """RUN_DIR/eval/step_<N>.jsonl, whole or not at all (written aside, then renamed)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / (self.records_name or f"step_{step}.jsonl")
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        with tmp.open("w") as f:
            for name, per_prompt in results.items():
                for result in per_prompt:
                    f.write(json.dumps({"set": name, **result.to_record()}) + "\n")
        os.replace(tmp, path)
