"""The eval phase: between two steps, the job's own vLLM engines sample every eval prompt
``eval.n_samples`` times with the current weights, the set's reward scores the samples,
and the set's ``val/<set>/...`` metrics and per-prompt records come back.

The engines are the run's rollout backend: the colocated engines of every training rank,
or the rollout ranks of a disaggregated run, which sample after the step's weight update
(commands run in the order sent) and stamp the policy version they served
(``val/<set>/policy_version``: the weight updates they had loaded in this launch, the one
the training ranks hold).

It leaves training as it was (a run with eval on trains exactly as with it off):
- its prompts are sets of their own (the task's held-out split, a file, a reasoning-gym
  set), never the training loader's, whose cursor it does not touch; a set sharing a
  prompt with the training data is refused;
- every sample has its own seed (from eval.seed, the set, the prompt and the sample), and
  the generation puts back every random generator of the process that runs vLLM and drops
  the prefix cache it filled (:meth:`~megatron_rl.rollout.replicas.Replicas.generate_eval`);
- nothing it samples enters a training batch.

The backend deals each set's prompts to its replicas and returns every sample to every
training rank; each training rank scores a contiguous share of the prompts, every rank gets
every prompt's result, and one rank writes them.
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
from megatron_rl.rollout.backend import RolloutBackend
from megatron_rl.rollout.replicas import contiguous_share
from megatron_rl.rollout.seeds import MAX_SAMPLES
from megatron_rl.rollout.types import Sampling

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
    """Evaluates the backend's current weights on every set; :meth:`evaluate` on every rank."""

    def __init__(
        self,
        config: EvalConfig,
        sets: Sequence[EvalSet],
        backend: RolloutBackend,
        scores: Mapping[str, Score],
        decode: Decode,
        sampling: Sampling,
        out_dir: Path,
        write: bool,
        records_name: Optional[str] = None,
    ):
        self.config = config
        self.sets = list(sets)
        self.backend = backend
        """The colocated engines or the rollout ranks' client (``generate_eval``)."""
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
        started = time.perf_counter()
        metrics: dict[str, float] = {}
        results = {}
        for eval_set in self.sets:
            results[eval_set.name], version = self._evaluate_set(eval_set)
            metrics.update(set_metrics(eval_set.name, results[eval_set.name], self.config.pass_k))
            if version is not None:  # rollout ranks of their own: the version they sampled
                metrics[f"val/{eval_set.name}/policy_version"] = version
        if self.write:
            self._write(step, results)
        metrics["timing/eval_s"] = time.perf_counter() - started
        return metrics

    def _evaluate_set(self, eval_set: EvalSet) -> tuple[list[PromptResult], Optional[int]]:
        """Every prompt's result, in the set's order, the same list on every rank, and the
        policy version stamped on the samples (None: colocated engines)."""
        seeds = [sample_seed(self.config.seed, eval_set.name, i) for i in range(len(eval_set))]
        generated = self.backend.generate_eval(eval_set.prompt_ids, self.sampling, seeds)
        world = dist.get_world_size()
        mine = contiguous_share(len(eval_set), world, dist.get_rank())
        groups = [generated.groups[i] for i in mine]
        texts = [self.decode(s.token_ids) for group in groups for s in group]
        answers = [eval_set.answers[i] for i, group in zip(mine, groups) for _ in group]
        scores, _ = self.scores[eval_set.reward](texts, answers) if texts else ([], {})
        local, cursor = [], 0
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
        everyone: list = [None] * world
        dist.all_gather_object(everyone, local)
        results = sorted((r for share in everyone for r in share), key=lambda r: r.prompt_id)
        if [r.prompt_id for r in results] != list(range(len(eval_set))):
            raise RuntimeError(f"eval set {eval_set.name!r}: the ranks returned {len(results)} of {len(eval_set)}")
        return results, generated.policy_version

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
