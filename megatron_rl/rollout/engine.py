"""vLLM as the rollout engine, colocated with training in the same SPMD processes.

Every training rank builds one engine with vLLM's ``external_launcher`` executor, so
vLLM reuses the existing process group (torchrun/srun) instead of spawning workers. vLLM
lays ranks out as ExternalDP x PP x TP: with engine TP ``t`` at world ``W`` there are
``W/t`` independent engines, each fed its own prompts (ranks of one TP group must submit
the same requests). This works for MoE models too, where vLLM's own data parallelism
needs collectives its CPU backend lacks.

Logprobs are vLLM's "processed" ones (after temperature), i.e. log-softmax of
logits / T, which is what the trainer recomputes with Megatron. With HAPO's adaptive
temperature (Sampling.entropy_stats) T is the per-token T_t of rollout/adaptive_temperature.py.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, Union

import torch

from megatron_rl.bridge.lora_export import write_peft_files
from megatron_rl.launch import startup_gc
from megatron_rl.platform import torch_compat, vllm_compat, vllm_shm
from megatron_rl.rollout import vllm_env
from megatron_rl.rollout.types import EngineConfig, OnGroup, Sample, Sampling, lora_slot_rank

Prompt = Union[str, Sequence[int]]

ADAPTER_NAME, ADAPTER_ID = "policy", 1
"""The one LoRA adapter an engine serves (the policy's), reloaded in place at every sync."""


def prefill_waves(tokens: Sequence[int], budget: int) -> list[range]:
    """Consecutive runs of items whose ``tokens`` sum to at most ``budget`` each (an item
    over the budget alone in its run); one empty run for no items."""
    waves, start, total = [], 0, 0
    for i, count in enumerate(tokens):
        if i > start and total + count > budget:
            waves.append(range(start, i))
            start, total = i, 0
        total += count
    waves.append(range(start, len(tokens)))
    return waves


class RolloutEngine:
    """A colocated vLLM engine: generate, continue, and load new weights in place; one per
    rank (the ranks of one engine TP group share a replica). It generates what its own rank
    is given; :class:`~megatron_rl.rollout.replicas.Replicas` deals a batch over a world's
    replicas and is the :class:`~megatron_rl.rollout.backend.RolloutBackend`."""

    config: EngineConfig

    def __init__(self, model_dir: Union[str, Path], config: EngineConfig = EngineConfig()):
        import torch.distributed as dist

        self.config = config
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        config.validate(world)
        self.tp = config.tensor_parallel_size
        self.replica = rank // self.tp
        """Which independent engine this rank belongs to (vLLM's ExternalDP index)."""
        self.num_replicas = world // self.tp
        cache = Path(config.cache_dir) if config.cache_dir else None
        vllm_env.prepare_environment(cache, config.cpu_kv_cache_gib, config.threads, config.log_level)
        on_cpu = not torch.cuda.is_available()
        if on_cpu:
            vllm_compat.install()  # per-job shm names, the MoE reload repack, plain LM heads
            torch_compat.VEC_ISA_PROBE_MEMO.apply()  # its C++ kernels' ISA probes, once per machine
        kwargs = {}
        if config.lora_rank:
            kwargs.update(enable_lora=True, max_lora_rank=lora_slot_rank(config.lora_rank), max_loras=1)
            kwargs["lora_target_modules"] = list(config.lora_modules) or None
        if dist.is_initialized():
            kwargs["distributed_executor_backend"] = "external_launcher"
            if on_cpu:
                if self.tp > 1 and rank % self.tp == 0:
                    vllm_shm.remove_stale_shm()
                dist.barrier()
        from vllm import LLM

        startup_gc.freeze_heap()  # vLLM's build collects several times: not over what lives now
        start = time.perf_counter()
        with vllm_compat.cpu_linear_format(config.cpu_linear if on_cpu else "packed"):
            self.llm = LLM(
                model=str(model_dir),
                tokenizer=str(model_dir),
                skip_tokenizer_init=not config.load_tokenizer,
                dtype=config.dtype,
                tensor_parallel_size=self.tp,
                max_model_len=config.max_model_len,
                # Ranks of one TP group must sample identically; replicas must differ.
                seed=config.seed + self.replica,
                enforce_eager=config.enforce_eager,
                gpu_memory_utilization=config.gpu_memory_utilization,
                logprobs_mode="processed_logprobs",
                logits_processors=self._logits_processors(),
                **kwargs,
            )
        self.build_s = time.perf_counter() - start
        self._on_cpu = on_cpu
        self._adapter = None
        """The LoRARequest every request goes through once an adapter is loaded (None: the base)."""
        self._adapter_dir: Optional[tempfile.TemporaryDirectory] = None

    # -- generation -------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling: Sampling = Sampling(),
        seeds: Optional[Sequence[int]] = None,
        max_tokens: Optional[Sequence[int]] = None,
        on_group: Optional[OnGroup] = None,
    ) -> list[list[Sample]]:
        """``sampling.n`` samples per prompt, in prompt order. ``seeds``: one per prompt
        (vLLM seeds its samples seed, seed + 1, ...); None: the engine's own generator.
        ``max_tokens``: one response budget per prompt (multi-turn episodes each have
        their own room left); None: ``sampling.max_tokens`` for all. ``on_group``: called
        with a prompt's index and its samples as soon as all of them finish, while the
        others still generate (the samples without routes: those come with the result)."""
        prompt_ids = [self._ids(p) for p in prompts]
        if seeds is not None and len(seeds) != len(prompt_ids):
            raise ValueError(f"{len(seeds)} seeds for {len(prompt_ids)} prompts")
        budgets = [sampling.max_tokens] * len(prompt_ids) if max_tokens is None else [int(m) for m in max_tokens]
        if len(budgets) != len(prompt_ids) or min(budgets, default=1) < 1:
            raise ValueError(f"max_tokens needs one budget >= 1 per prompt, got {budgets} for {len(prompt_ids)}")
        outputs, routes = [], {}
        for wave in self._waves(prompt_ids, sampling.n, seeds):
            finished = None
            if on_group is not None:

                def finished(position, out, wave=wave):
                    i = wave[position]
                    on_group(i, [self._sample(prompt_ids[i], [], [], c, sampling, budgets[i]) for c in out.outputs])

            done, recorded = self._run(
                [prompt_ids[i] for i in wave],
                sampling,
                sampling.n,
                [budgets[i] for i in wave],
                None if seeds is None else [seeds[i] for i in wave],
                finished,
            )
            outputs.extend(done)
            routes.update(recorded)
        return [
            [
                self._with_routes(
                    self._sample(ids, [], [], completion, sampling, budget),
                    routes.get((out.request_id, completion.index)),
                )
                for completion in out.outputs
            ]
            for ids, budget, out in zip(prompt_ids, budgets, outputs)
        ]

    def close(self) -> None:
        """Nothing to release: the engine lives as long as the process, whose exit frees
        vLLM's shared memory (:mod:`megatron_rl.launch.process_exit`)."""

    def continue_(self, samples: Sequence[Sample], sampling: Sampling) -> list[Sample]:
        """Extend unfinished samples by at most one more window (finished ones are returned as is)."""
        todo = [i for i, s in enumerate(samples) if not s.finished]
        result = list(samples)
        if not todo:
            return result
        budgets = [sampling.max_tokens - len(samples[i].token_ids) for i in todo]
        outputs, routes = self._run([samples[i].prompt_ids + samples[i].token_ids for i in todo], sampling, 1, budgets)
        for i, budget, out in zip(todo, budgets, outputs):
            s = samples[i]
            extended = self._sample(s.prompt_ids, s.token_ids, s.logprobs, out.outputs[0], sampling, budget)
            result[i] = self._with_routes(extended, routes.get((out.request_id, 0)), s.routes)
        return result

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Logprob of every token after the first under the current weights (T = 1).

        Used by the parity guard: the same numbers Megatron computes on the same tokens.
        """
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        requests = [self._tokens_prompt(list(s)) for s in sequences]
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self._adapter)
        result = []
        for seq, out in zip(sequences, outputs):
            result.append([entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], seq[1:])])
        return result

    # -- weights ----------------------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
        """Load HF-named full tensors in place (one bucket of whole decoder layers); call
        :meth:`finish_weight_update` after the last. Returns the path taken: ``inplace``
        (:mod:`megatron_rl.rollout.inplace_load`, CPU) or ``reload`` (vLLM's reload_weights)."""
        from megatron_rl.rollout import inplace_load

        return self.llm.collective_rpc(inplace_load.load_on_worker, args=(list(named_tensors),))[0]

    def check_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]):
        """Read back what this engine serves for a bucket it has loaded and compare it with
        the bucket, exactly (:mod:`megatron_rl.rollout.weight_check`); the workers' results
        merged into one ``WeightCheckResult``."""
        from megatron_rl.rollout import weight_check

        results = self.llm.collective_rpc(weight_check.check_on_worker, args=(list(named_tensors),))
        return weight_check.WeightCheckResult.merge_all(results)

    def load_adapter(self, tensors: dict[str, torch.Tensor], peft_config: dict) -> None:
        """Fill the engine's LoRA slot with a PEFT adapter (``tensors`` by PEFT key, whole, in
        the engine's dtype; ``peft_config`` its adapter_config.json) and send every request
        through it from now on. vLLM reads adapters from a directory: this engine's own,
        rewritten at each load and read at once (the engine runs in this process); the slot
        is reloaded in place (one adapter id for the run). Call
        :meth:`finish_weight_update` after it."""
        from vllm.lora.request import LoRARequest

        if not self.config.lora_rank:
            raise ValueError("load_adapter needs an engine built with a LoRA slot (EngineConfig.lora_rank > 0)")
        if self._adapter_dir is None:
            self._adapter_dir = tempfile.TemporaryDirectory(prefix="megatron-rl-adapter-")
        directory = write_peft_files(Path(self._adapter_dir.name), tensors, peft_config)
        self.llm.llm_engine.add_lora(LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(directory), load_inplace=True))
        self._adapter = LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(directory))

    def finish_weight_update(self) -> None:
        """Drop cached prefixes (computed with the old weights) after the last bucket."""
        self.drop_prefix_cache()

    def drop_prefix_cache(self) -> None:
        """Forget every cached prefix: the next generation computes its prompts afresh."""
        self.llm.reset_prefix_cache()

    # -- memory -----------------------------------------------------------------------

    def sleep(self) -> None:
        """Free weights and KV cache on GPU between rollouts (no-op on CPU)."""
        if not self._on_cpu:
            self.llm.sleep(level=1)

    def wake(self) -> None:
        if not self._on_cpu:
            self.llm.wake_up()

    # -- internals --------------------------------------------------------------------

    def _ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not self.config.load_tokenizer:
                raise ValueError("text prompts need the tokenizer: build the engine with load_tokenizer=True")
            return list(self.llm.get_tokenizer().encode(prompt, add_special_tokens=False))
        return [int(t) for t in prompt]

    def _logits_processors(self) -> list:
        if not self.config.adaptive_temperature:
            return []
        from megatron_rl.rollout.adaptive_temperature import AdaptiveTemperatureProcessor

        return [AdaptiveTemperatureProcessor]

    def _extra_args(self, sampling: Sampling) -> Optional[dict]:
        if not sampling.adaptive:
            return None
        if not self.config.adaptive_temperature:
            raise ValueError(
                "Sampling.entropy_stats with temperature_tau > 0 needs an engine built "
                "with EngineConfig(adaptive_temperature=True)"
            )
        if sampling.temperature <= 0:
            raise ValueError(
                f"the adaptive temperature needs random sampling (temperature > 0), "
                f"got temperature={sampling.temperature}"
            )
        from megatron_rl.rollout.adaptive_temperature import extra_args

        return extra_args(sampling.temperature_tau, sampling.entropy_stats)

    @staticmethod
    def _tokens_prompt(ids: list[int]):
        from vllm.inputs import TokensPrompt

        return TokensPrompt(prompt_token_ids=ids)

    def _waves(self, prompt_ids: list[list[int]], n: int, seeds: Optional[Sequence[int]]) -> list[range]:
        """The prompts in one generate call, or, for seeded prompts on CPU, in consecutive
        waves whose prefill fits vLLM's per-step token budget: vLLM 0.32's CPU model runner
        fails on a seeded request whose prefill is split over steps (``_bookkeeping_sync``
        rewinds its generator with ``set_offset``, which CPU generators lack). Each sample
        has its own seed, so the waves sample what one call would."""
        if seeds is None or not self._on_cpu:
            return [range(len(prompt_ids))]
        budget = self.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
        return prefill_waves([len(ids) * n for ids in prompt_ids], budget)

    def _run(
        self,
        prompt_ids: list[list[int]],
        sampling: Sampling,
        n: int,
        budgets: list[int],
        seeds: Optional[Sequence[int]] = None,
        on_output: Optional[Callable] = None,
    ):
        from vllm import SamplingParams

        if sampling.stop and not self.config.load_tokenizer:
            raise ValueError("stop strings need the tokenizer: use stop_token_ids or load_tokenizer=True")
        params = []
        for i, budget in enumerate(budgets):
            window = budget if sampling.window is None else min(sampling.window, budget)
            params.append(
                SamplingParams(
                    n=n,
                    max_tokens=max(window, 1),
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    stop=list(sampling.stop) or None,
                    stop_token_ids=list(sampling.stop_token_ids) or None,
                    logprobs=0 if sampling.logprobs else None,
                    detokenize=self.config.load_tokenizer and bool(sampling.stop),
                    extra_args=self._extra_args(sampling),
                    seed=None if seeds is None else int(seeds[i]),
                )
            )
        from megatron_rl.rollout import routes

        requests = [self._tokens_prompt(ids) for ids in prompt_ids]
        if not self.config.record_routes:
            return self._generate(requests, params, on_output), {}
        hf = self.llm.llm_engine.model_config.hf_config
        self.llm.collective_rpc(routes.start_on_worker, args=(hf.num_hidden_layers, hf.num_experts_per_tok))
        try:
            outputs = self._generate(requests, params, on_output)
        finally:
            recorded = self.llm.collective_rpc(routes.take_on_worker)[0]
        return outputs, recorded

    def _generate(self, requests: list, params: list, on_output: Optional[Callable]) -> list:
        """vLLM's outputs for ``requests``, in order; with ``on_output``, each request's
        output is handed to it (with the request's position) the step it finishes. That
        path queues the requests (``LLM.enqueue``) and drives vLLM's engine step by step
        itself, as ``LLM.generate`` does inside."""
        if on_output is None:
            return self.llm.generate(requests, params, use_tqdm=False, lora_request=self._adapter)
        queued = self.llm.enqueue(requests, params, use_tqdm=False, lora_request=self._adapter)
        # enqueue answers vLLM's internal ids (``<id>-<8 random characters>``); the outputs carry <id>.
        position = {rid.rpartition("-")[0] or rid: i for i, rid in enumerate(queued)}
        engine = self.llm.llm_engine
        outputs: list = [None] * len(requests)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[position[out.request_id]] = out
                    on_output(position[out.request_id], out)
        return outputs

    @staticmethod
    def _with_routes(
        sample: Sample, recorded: Optional[torch.Tensor], earlier: Optional[torch.Tensor] = None
    ) -> Sample:
        """``sample`` with the routes of its input positions: this call's recording, and
        where it has none (a continuation's prefix-cache hits) the earlier window's."""
        if recorded is None and earlier is None:
            return sample
        length = len(sample.prompt_ids) + len(sample.token_ids) - 1
        template = recorded if recorded is not None else earlier
        routes = torch.full((length, *template.shape[1:]), -1, dtype=torch.int16)
        if recorded is not None:
            routes[: min(length, recorded.shape[0])] = recorded[:length]
        if earlier is not None:
            n = min(earlier.shape[0], length)
            routes[:n] = torch.where(routes[:n] >= 0, routes[:n], earlier[:n])
        return dataclasses.replace(sample, routes=routes)

    @staticmethod
    def _sample(prompt_ids, prev_tokens, prev_logprobs, completion, sampling: Sampling, budget: int) -> Sample:
        tokens = list(completion.token_ids)
        logprobs = []
        if sampling.logprobs:
            logprobs = [entry[token].logprob for entry, token in zip(completion.logprobs, tokens)]
        reason = "stop" if completion.finish_reason == "stop" else "length"
        if reason == "length" and len(tokens) < budget:
            reason = "window"
        return Sample(
            prompt_ids=list(prompt_ids),
            token_ids=list(prev_tokens) + tokens,
            logprobs=list(prev_logprobs) + logprobs,
            finish_reason=reason,
        )
