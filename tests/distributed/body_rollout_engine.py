"""The colocated vLLM engine (external_launcher, ExternalDP) against transformers: the cases
of test_weight_sync.py's engine tests, run by body_weight_sync.py in its fp32 launches on
the engine it syncs into (MoE with vLLM TP1: four replicas; dense with vLLM TP2: two), before
any sync. Each case takes the engine and a transformers model of the weights it serves;
prompts differ per replica. transformers computes the reference logprobs and greedy
continuations.
"""

import torch
import torch.distributed as dist

from megatron_rl.rollout import Sampling
from megatron_rl.rollout.seeds import MAX_SAMPLES, prompt_seeds
from megatron_rl_lab.testing.hf_models import token_logprobs

MAX_MODEL_LEN = 128
"""What the engine must hold: the seeded case's prompts of 100 tokens and their samples."""


def prompts_of_replica(eng, count=3):
    g = torch.Generator().manual_seed(100 + eng.replica)
    return [
        torch.randint(3, 96, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist() for _ in range(count)
    ]


def sampled_logprobs_match_transformers(eng, ref):
    temperature = 0.7
    groups = eng.generate(prompts_of_replica(eng), Sampling(n=3, max_tokens=12, temperature=temperature))
    worst, reasons = 0.0, set()
    for group in groups:
        assert len(group) == 3
        for s in group:
            assert 1 <= len(s.token_ids) <= 12 and len(s.logprobs) == len(s.token_ids)
            reasons.add(s.finish_reason)
            seq = s.prompt_ids + s.token_ids
            with torch.no_grad():
                logits = ref(torch.tensor([seq])).logits[0, len(s.prompt_ids) - 1 : -1] / temperature
            expect = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.token_ids)[:, None])[:, 0]
            worst = max(worst, float((expect - torch.tensor(s.logprobs)).abs().max()))
    assert worst < 1e-5, worst  # fp32; measured <= 2.6e-6 (docs/benchmarks.md)
    assert reasons <= {"stop", "length"}, reasons
    # The same prompts on every replica: replicas must not sample identically.
    same = eng.generate([[5, 6, 7]], Sampling(n=4, max_tokens=8, temperature=1.0))[0]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [s.token_ids for s in same])
    distinct_replicas = len({str(x) for x in everyone})
    assert distinct_replicas == eng.num_replicas, (distinct_replicas, eng.num_replicas)
    return {"max_abs_diff": worst, "finish_reasons": sorted(reasons), "build_s": eng.build_s}


def seeded_samples_do_not_depend_on_replica_or_batch(eng, ref):
    """Per-prompt seeds (rollout.seed_per_prompt): a prompt's samples are the same on every
    replica (each has its own engine generator) and alone or batched with others; other
    seeds give other samples, and the n samples of one prompt differ from each other."""
    sampling = Sampling(n=4, max_tokens=8, temperature=1.0)
    prompts, seeds = [[5, 6, 7], [9, 4, 3, 8], [11, 12]], prompt_seeds(1234, [0, 0, 1], [3, 7, 3], 4)
    batched = eng.generate(prompts, sampling, seeds)
    alone = eng.generate(prompts[:1], sampling, seeds[:1])[0]
    reordered = eng.generate(prompts[::-1], sampling, seeds[::-1])[::-1]
    other = eng.generate(prompts[:1], sampling, [seeds[0] + MAX_SAMPLES])[0]
    ids = lambda group: [s.token_ids for s in group]  # noqa: E731
    assert ids(alone) == ids(batched[0]) and [ids(g) for g in reordered] == [ids(g) for g in batched]
    assert ids(other) != ids(alone) and len({str(x) for x in ids(alone)}) > 1
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [ids(g) for g in batched])
    assert all(x == everyone[0] for x in everyone), "replicas sampled a seeded prompt differently"
    # More prompt tokens than vLLM prefills in one step (its CPU runner fails on a seeded
    # request whose prefill is split): the batch samples what each prompt samples alone.
    budget = eng.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    g = torch.Generator().manual_seed(7)
    long = [torch.randint(3, 96, (100,), generator=g).tolist() for _ in range(budget // (100 * 4) + 2)]
    long_seeds = prompt_seeds(1234, [0] * len(long), list(range(len(long))), 4)
    over = eng.generate(long, sampling, long_seeds)
    for i in (0, len(long) - 1):
        assert ids(over[i]) == ids(eng.generate(long[i : i + 1], sampling, long_seeds[i : i + 1])[0])
    return {"replicas": eng.num_replicas, "over_budget_prompts": len(long), "budget": budget}


def streamed_groups_arrive_as_they_finish(eng, ref):
    """``on_group``: each prompt's group is handed over once, before the call returns and
    as it finishes (a group with a 2-token budget before one with 24), and equals what the
    call returns and what the same seeded call samples without the callback."""
    sampling = Sampling(n=3, max_tokens=24, temperature=1.0, stop_token_ids=())
    prompts, seeds = [[5, 6, 7], [9, 4, 3, 8], [11, 12]], prompt_seeds(99, [0, 0, 0], [1, 2, 3], 3)
    budgets = [24, 2, 24]
    heard: list = []
    streamed = eng.generate(prompts, sampling, seeds, budgets, on_group=lambda i, g: heard.append((i, g)))
    plain = eng.generate(prompts, sampling, seeds, budgets)
    ids = lambda group: [s.token_ids for s in group]  # noqa: E731
    assert sorted(i for i, _ in heard) == [0, 1, 2], [i for i, _ in heard]
    assert heard[0][0] == 1, [i for i, _ in heard]  # the short budget finished first
    for i, group in heard:
        assert ids(group) == ids(streamed[i]) == ids(plain[i])
        assert [s.logprobs for s in group] == [s.logprobs for s in streamed[i]]
    return {"order": [i for i, _ in heard]}


def greedy_reference(ref, prompt, max_tokens):
    seq = list(prompt)
    for _ in range(max_tokens):
        with torch.no_grad():
            nxt = int(ref(torch.tensor([seq])).logits[0, -1].argmax())
        seq.append(nxt)
        if nxt == 2:  # eos
            break
    return seq[len(prompt) :]


def windows_continue_to_the_one_shot_answer(eng, ref):
    prompts = prompts_of_replica(eng, 4)
    greedy = Sampling(max_tokens=20, temperature=0.0)
    one_shot = [g[0] for g in eng.generate(prompts, greedy)]
    windowed = Sampling(max_tokens=20, temperature=0.0, window=6)
    samples = [g[0] for g in eng.generate(prompts, windowed)]
    calls = 1
    assert any(s.finish_reason == "window" for s in samples)
    while not all(s.finished for s in samples):
        samples = eng.continue_(samples, windowed)
        calls += 1
    for a, b, p in zip(one_shot, samples, prompts):
        assert a.token_ids == b.token_ids, (a.token_ids, b.token_ids)
        assert a.finish_reason == b.finish_reason
        assert b.token_ids == greedy_reference(ref, p, 20)
        assert len(b.logprobs) == len(b.token_ids)
    return {"calls": calls, "lengths": [len(s.token_ids) for s in samples]}


def reloaded_weights_serve_new_logprobs(eng, ref):
    """Last of the cases: it leaves the engine serving other weights than the saved model's."""
    g = torch.Generator().manual_seed(7)
    new = {name: t + 0.05 * torch.randn(t.shape, generator=g) for name, t in ref.state_dict().items()}
    ref.load_state_dict(new)
    seqs = [p + [9, 10, 11] for p in prompts_of_replica(eng)]
    before = eng.prompt_logprobs(seqs)
    # Two buckets, split between decoder layers: vLLM processes a layer once all of
    # its weights arrived in one reload, so a bucket must never split a layer.
    first = {k: v for k, v in new.items() if ".layers." not in k or ".layers.0." in k}
    eng.load_weights(first.items())
    eng.load_weights((k, v) for k, v in new.items() if k not in first)
    eng.finish_weight_update()
    after = eng.prompt_logprobs(seqs)
    expect = [token_logprobs(ref, s) for s in seqs]
    diff = max(abs(a - e) for row_a, row_e in zip(after, expect) for a, e in zip(row_a, row_e))
    moved = max(abs(a - b) for row_a, row_b in zip(after, before) for a, b in zip(row_a, row_b))
    assert diff < 1e-5, diff  # fp32; measured <= 2e-6
    assert moved > 1e-2, moved  # the update did change the served model
    return {"max_abs_diff": diff, "moved": moved}


CASES = {  # in this order: "reload" changes the served weights
    "sampled_logprobs": sampled_logprobs_match_transformers,
    "windows": windows_continue_to_the_one_shot_answer,
    "seeded": seeded_samples_do_not_depend_on_replica_or_batch,
    "streamed": streamed_groups_arrive_as_they_finish,
    "reload": reloaded_weights_serve_new_logprobs,
}
