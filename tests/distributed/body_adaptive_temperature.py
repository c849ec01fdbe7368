"""torchrun body: HAPO's adaptive temperature inside the colocated vLLM engine (external_launcher).

Arguments: WORKDIR. World 1 (one engine per process). transformers is the reference: for
each generated token the test computes, from HF's logits, the entropy of softmax(logits / T),
ĥ under the given stats (by hand, not via megatron_rl) and T_t = T·(1 + τ·ĥ), and checks
vLLM's logprob against log_softmax(logits / T_t). Megatron (loaded from the same HF
weights) then recomputes the temperatures with megatron_rl.trainer.hapo.
"""

import math
import sys
from pathlib import Path

import torch

from megatron_rl.algorithms.hapo import EntropyStats
from megatron_rl.rollout import EngineConfig, RolloutEngine, Sampling
from megatron_rl_lab.testing.hf_models import load_reference, save_tiny_model_on_rank0
from megatron_rl_lab.testing.tiny import TINY_DENSE
from megatron_rl_lab.testing.torchrun import run_cases

WORK = Path(sys.argv[1])
T = 0.8
SEQ = 32
STATE = {}


def setup():
    if not STATE:
        path = save_tiny_model_on_rank0(TINY_DENSE, WORK / "dense", seed=3)
        STATE["dir"] = path
        STATE["engine"] = RolloutEngine(
            path, EngineConfig(max_model_len=128, seed=11, load_tokenizer=False, cache_dir=str(WORK / "cache"))
        )
        STATE["ref"] = load_reference(path)
    return STATE["dir"], STATE["engine"], STATE["ref"]


def prompts(count=4, seed=100):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 96, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist() for _ in range(count)
    ]


def hf_response_logits(ref, sample):
    """HF logits [R, V] at the positions that predicted each response token."""
    seq = sample.prompt_ids + sample.token_ids
    with torch.no_grad():
        return ref(torch.tensor([seq])).logits[0, len(sample.prompt_ids) - 1 : -1].double()


def entropy_at_base(logits):
    logp = torch.log_softmax(logits / T, -1)
    return -(logp.exp() * logp).sum(-1)


def hand_h_hat(entropy, stats):
    """The spec's ĥ written out independently: e = log H, h = (e − pivot)/scale, divided by
    pos_max (h > 0) or neg_max (h ≤ 0), clamped to [−1, 1]."""
    out = []
    for value in entropy.tolist():
        h = (math.log(max(value, 1e-8)) - stats.pivot) / stats.scale
        h = h / stats.pos_max if h > 0 else h / stats.neg_max
        out.append(min(1.0, max(-1.0, h)))
    return torch.tensor(out, dtype=torch.float64)


def given_stats(engine, ref):
    """Realistic 'previous step' statistics: quantile 0.5 of log-entropy at T over plain samples."""
    if "stats" not in STATE:
        samples = [
            s for g in engine.generate(prompts(4, seed=7), Sampling(n=2, max_tokens=16, temperature=T)) for s in g
        ]
        e = torch.cat([entropy_at_base(hf_response_logits(ref, s)) for s in samples]).log()
        pivot = float(e.quantile(0.5))
        scale = float((e - pivot).square().mean().sqrt())
        h = (e - pivot) / scale
        STATE["stats"] = EntropyStats(pivot, scale, float(h.max()), float(-h.min()))
    return STATE["stats"]


def check_samples(ref, samples, tau, stats):
    """Max |vLLM − HF at T_t|, the T_t themselves and max |vLLM − HF at plain T|."""
    worst, temps, moved = 0.0, [], 0.0
    for s in samples:
        assert len(s.logprobs) == len(s.token_ids) >= 1
        logits = hf_response_logits(ref, s)
        if stats is None:
            t_t = torch.full((len(s.token_ids),), T, dtype=torch.float64)
        else:
            t_t = T * (1.0 + tau * hand_h_hat(entropy_at_base(logits), stats))
        tokens = torch.tensor(s.token_ids)[:, None]
        expect = torch.log_softmax(logits / t_t[:, None], -1).gather(1, tokens)[:, 0]
        plain = torch.log_softmax(logits / T, -1).gather(1, tokens)[:, 0]
        got = torch.tensor(s.logprobs, dtype=torch.float64)
        worst = max(worst, float((expect - got).abs().max()))
        moved = max(moved, float((plain - got).abs().max()))
        temps += t_t.tolist()
    return worst, torch.tensor(temps), moved


def adaptive_logprobs_match_transformers(tau):
    _, engine, ref = setup()
    stats = given_stats(engine, ref)
    sampling = Sampling(n=2, max_tokens=16, temperature=T, temperature_tau=tau, entropy_stats=stats)
    samples = [s for g in engine.generate(prompts(), sampling) for s in g]
    worst, temps, moved = check_samples(ref, samples, tau, stats)
    assert worst < 1e-4, worst
    assert float(temps.std()) > 1e-3 and len({round(t, 6) for t in temps.tolist()}) > 10, temps
    assert moved > (5e-3 if tau < 0.1 else 5e-2), moved  # a no-op processor would give plain-T logprobs
    STATE.setdefault("adaptive_samples", {})[tau] = samples
    return {
        "max_abs_diff": worst,
        "tokens": len(temps),
        "t_min": float(temps.min()),
        "t_max": float(temps.max()),
        "t_std": float(temps.std()),
        "max_diff_vs_plain_T": moved,
    }


def mixed_batch_leaves_plain_requests_alone():
    """One vLLM batch, adaptive and plain requests interleaved (rows move as requests finish)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from megatron_rl.rollout.adaptive_temperature import extra_args

    _, engine, ref = setup()
    tau, stats = 0.5, given_stats(engine, ref)
    ps = prompts(6, seed=5)
    params = [
        SamplingParams(
            max_tokens=4 + 3 * i,
            temperature=T,
            logprobs=0,
            detokenize=False,
            extra_args=extra_args(tau, stats) if i % 2 else None,
        )
        for i in range(len(ps))
    ]
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], params, use_tqdm=False)

    class S:  # the fields check_samples reads
        def __init__(self, prompt, completion):
            self.prompt_ids, self.token_ids = prompt, list(completion.token_ids)
            self.logprobs = [entry[t].logprob for entry, t in zip(completion.logprobs, self.token_ids)]

    plain = [S(p, o.outputs[0]) for i, (p, o) in enumerate(zip(ps, outs)) if i % 2 == 0]
    adaptive = [S(p, o.outputs[0]) for i, (p, o) in enumerate(zip(ps, outs)) if i % 2]
    plain_diff = check_samples(ref, plain, 0.0, None)[0]
    adaptive_diff, _, moved = check_samples(ref, adaptive, tau, stats)
    assert plain_diff < 1e-4, plain_diff
    assert adaptive_diff < 1e-4 and moved > 5e-2, (adaptive_diff, moved)
    # Through RolloutEngine without the setting: plain T as before.
    samples = [s for g in engine.generate(prompts(3, seed=9), Sampling(n=2, max_tokens=10, temperature=T)) for s in g]
    engine_plain = check_samples(ref, samples, 0.0, None)[0]
    assert engine_plain < 1e-4, engine_plain
    # Greedy + adaptive is refused with a clear error.
    try:
        engine.generate([[5, 6, 7]], Sampling(temperature=0.0, temperature_tau=0.05, entropy_stats=stats))
    except ValueError as err:
        assert "random sampling" in str(err), err
    else:
        raise AssertionError("greedy sampling with the adaptive temperature was accepted")
    return {
        "plain_max_abs_diff": plain_diff,
        "adaptive_max_abs_diff": adaptive_diff,
        "engine_plain_max_abs_diff": engine_plain,
    }


def megatron_recomputes_the_sampling_temperatures():
    """trainer.hapo on a world-1 Megatron actor loaded from the same HF weights."""
    from megatron_rl.bridge import load_hf
    from megatron_rl.models import build_model
    from megatron_rl.models.hf_config import arch_from_hf
    from megatron_rl.parallel import ParallelConfig, destroy, initialize
    from megatron_rl.schedules import TrainBatch, compute_logprobs
    from megatron_rl.schedules.batch import gather_response, pack_sequences
    from megatron_rl.trainer.hapo import hapo_token_fields

    path, engine, ref = setup()
    tau, stats = 0.5, given_stats(engine, ref)
    samples = STATE["adaptive_samples"][tau][:4]
    arch = arch_from_hf(path)
    initialize(ParallelConfig(), seed=1, model=arch.shape())
    try:
        chunks = build_model("actor", arch, ParallelConfig())
        load_hf(chunks, path, arch)
        prompt_lens, response_lens = [len(s.prompt_ids) for s in samples], [len(s.token_ids) for s in samples]
        tokens, mask = pack_sequences([s.prompt_ids for s in samples], [s.token_ids for s in samples], SEQ)
        mask = mask.bool()
        batch = TrainBatch(tokens=tokens, loss_mask=mask)
        fields = hapo_token_fields(
            chunks, batch, 2, arch.vocab_size, temperature=T, tau=tau, prev_stats=stats, pivot_quantile=0.8
        )
        # (a) the temperatures: HF-derived T_t, and vLLM's logprobs at them.
        temps = gather_response(fields.temperature, prompt_lens, response_lens)
        expect = [T * (1.0 + tau * hand_h_hat(entropy_at_base(hf_response_logits(ref, s)), stats)) for s in samples]
        temp_diff = max(float((a.double() - b).abs().max()) for a, b in zip(temps, expect))
        assert temp_diff < 1e-5, temp_diff
        assert bool((fields.temperature[~mask] == T).all())
        logp, entropy = compute_logprobs(
            chunks, TrainBatch(tokens=tokens, loss_mask=mask, temperature=fields.temperature), 2, arch.vocab_size
        )
        logp = gather_response(logp, prompt_lens, response_lens)
        logp_diff = max(float((a - torch.tensor(s.logprobs)).abs().max()) for a, s in zip(logp, samples))
        assert logp_diff < 1e-4, logp_diff
        # (b), (c): this step's stats and ĥ, by hand from HF's entropies at T.
        e = torch.cat([entropy_at_base(hf_response_logits(ref, s)) for s in samples]).log()
        pivot = float(e.quantile(0.8))
        mine = EntropyStats(pivot, float((e - pivot).square().mean().sqrt()), 0.0, 0.0)
        h = (e - mine.pivot) / mine.scale
        mine = EntropyStats(mine.pivot, mine.scale, float(h.max()), float(-h.min()))
        stat_diff = max(
            abs(getattr(fields.stats, k) - getattr(mine, k)) for k in ("pivot", "scale", "pos_max", "neg_max")
        )
        assert stat_diff < 1e-4, (fields.stats, mine)
        h_hat = torch.cat(gather_response(fields.h_hat, prompt_lens, response_lens)).double()
        h_diff = float((h_hat - hand_h_hat(e.exp(), mine)).abs().max())
        assert h_diff < 1e-4, h_diff
        assert bool((fields.h_hat[~mask] == 0).all())
        return {
            "temperature_max_abs_diff": temp_diff,
            "logprob_max_abs_diff": logp_diff,
            "stats_max_abs_diff": stat_diff,
            "h_hat_max_abs_diff": h_diff,
        }
    finally:
        destroy()


CASES = {
    "adaptive_tau_0.5": lambda: adaptive_logprobs_match_transformers(0.5),
    "adaptive_tau_0.05": lambda: adaptive_logprobs_match_transformers(0.05),
    "mixed_batch": mixed_batch_leaves_plain_requests_alone,
    "megatron_temperatures": megatron_recomputes_the_sampling_temperatures,
}

if __name__ == "__main__":
    run_cases(CASES)
