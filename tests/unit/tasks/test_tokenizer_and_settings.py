"""The tiny tokenizer (trained here, saved, reloaded as an HF tokenizer) and the base
model settings: cache hash, validation, and HF configs the Megatron side can read."""

import dataclasses

import pytest
from transformers import AutoTokenizer

from megatron_rl.models.hf_config import arch_from_hf
from megatron_rl.tasks import get_task
from megatron_rl.tasks.base_model import BaseModelSettings, hf_config
from megatron_rl.tasks.chat_format import render_chat, training_text
from megatron_rl.tasks.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def saved_tokenizer(tmp_path_factory):
    examples = get_task("digits_max_steps").generate(300, seed=0)
    directory = tmp_path_factory.mktemp("tok")
    train_tokenizer(["".join(training_text(e)) for e in examples]).save_pretrained(str(directory))
    return AutoTokenizer.from_pretrained(str(directory))


def test_chat_template_matches_the_documented_format(saved_tokenizer):
    messages = [{"role": "user", "content": "max of 3 7"}]
    text = saved_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>max of 3 7<|end|><|assistant|>" == render_chat(messages, True)
    assert saved_tokenizer.eos_token == "<|end|>" and saved_tokenizer.pad_token == "<|pad|>"


def test_digits_are_single_tokens_and_text_round_trips(saved_tokenizer):
    tok = saved_tokenizer
    ids = tok("max of 3 7 1", add_special_tokens=False).input_ids
    assert tok.convert_ids_to_tokens(ids)[-3:] == ["Ġ3", "Ġ7", "Ġ1"]
    full = "<|user|>max of 3 7<|end|><|assistant|>3 7 Answer: 7<|end|>"
    ids = tok(full, add_special_tokens=False).input_ids
    assert ids[-1] == tok.eos_token_id and tok.decode(ids) == full
    # byte-level: text the task never shows still encodes and decodes losslessly
    other = "Find $\\frac{1}{2}$ of 10 — é"
    assert tok.decode(tok(other, add_special_tokens=False).input_ids) == other


def test_settings_hash_is_stable_and_sensitive():
    base = BaseModelSettings()
    assert base.content_hash() == BaseModelSettings().content_hash()
    assert base.content_hash() != dataclasses.replace(base, seed=1).content_hash()
    assert base.content_hash() != dataclasses.replace(base, warmup_steps=61).content_hash()


def test_settings_validation():
    with pytest.raises(ValueError, match="allowed: \\['qwen3_moe', 'qwen2_moe', 'qwen3'\\]"):
        BaseModelSettings(family="llama4")
    with pytest.raises(ValueError, match="head_dim=16"):
        BaseModelSettings(head_dim=16)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "qwen3"])
def test_hf_configs_map_to_megatron_archs(family):
    settings = BaseModelSettings(family=family)
    arch = arch_from_hf(hf_config(settings, vocab_size=320, eos_id=1, pad_id=0))
    assert (arch.family, arch.hidden_size, arch.num_layers, arch.head_dim) == (family, 128, 2, 32)
    assert (arch.num_attention_heads, arch.num_query_groups, arch.vocab_size) == (4, 2, 320)
    if family == "qwen3":
        assert not arch.is_moe and arch.ffn_hidden_size == 256
    else:
        assert (arch.num_moe_experts, arch.moe_router_topk, arch.moe_ffn_hidden_size) == (8, 2, 128)
        assert arch.moe_router_pre_softmax is False  # norm_topk_prob=True: renormalised top-k
    assert arch.moe_shared_expert_intermediate_size == (256 if family == "qwen2_moe" else None)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "qwen3"])
def test_model_shape_is_the_shape_of_the_saved_hf_config(family):
    # Config validation checks layouts against model_shape() before the base exists; the
    # trainer then reads the built config.json: both must be the same numbers.
    settings = BaseModelSettings(family=family, num_layers=3, num_experts=6)
    assert settings.model_shape() == arch_from_hf(hf_config(settings, vocab_size=384, eos_id=1, pad_id=0)).shape()
    assert settings.model_shape().num_layers == 3
    assert settings.model_shape().num_moe_experts == (None if family == "qwen3" else 6)


@dataclasses.dataclass(frozen=True)
class _CountedBuild:
    """A BaseBuild that takes a moment and counts its builds in a shared file."""

    log: str

    def content_hash(self) -> str:
        return "0123456789abcdef"

    def build(self, out):
        import time

        with open(self.log, "a") as f:
            f.write("built\n")
        time.sleep(0.5)
        (out / "weights").write_text("w")
        return {"num_parameters": 1}


def _make(directory, log):
    from megatron_rl.tasks.base_model import make_tiny_base

    return make_tiny_base(directory, _CountedBuild(str(log)), verbose=False)["cached"]


def test_processes_asking_for_one_base_at_once_build_it_once(tmp_path):
    """Two runs sharing a base cache start together: one builds, the other waits and reuses it."""
    import multiprocessing

    directory, log = tmp_path / "bases" / "0123456789abcdef", tmp_path / "builds.log"
    with multiprocessing.get_context("fork").Pool(2) as pool:
        cached = pool.starmap(_make, [(directory, log)] * 2)
    assert sorted(cached) == [False, True] and log.read_text() == "built\n"
    assert (directory / "weights").read_text() == "w" and _make(directory, log) is True
