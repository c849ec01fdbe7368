"""`megatron-rl convert megatron-to-hf` of a LoRA checkpoint: a PEFT adapter directory that
peft + transformers load, and with --merge a full HF directory, both computing Megatron's
logits with the adapters.

A tiny qwen3 actor loaded from an HF base, with adapters on QKV, the attention output, FC1 and
FC2 and seeded non-zero B (so every adapter moves the logits), is saved as a trainer saves a
LoRA run (``extra["lora"]``), exported both ways, and run by transformers in fp32 on the same
tokens. Both sides compute the same sums in another order (measured: 2.4e-7 and 4.4e-7 of the
logits' scale); 1e-5 of the scale leaves a wrong row split of B (q, k, v or gate, up swapped)
nowhere to hide: that moves the logits by more than the adapters' own effect.
"""

import json

import pytest
import torch

from megatron_rl.bridge.cli import main
from megatron_rl.bridge.hf_files import weights_digest
from megatron_rl.bridge.parity import make_tiny_hf

RELATIVE_TOL = 1e-5
LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["qkv", "proj", "fc1", "fc2"]}


@pytest.fixture(scope="module")
def lora_run(world_of_one, tmp_path_factory):
    from megatron_rl import checkpoint, platform
    from megatron_rl.bridge.load import load_hf
    from megatron_rl.models.builder import BuildOptions, build_model
    from megatron_rl.models.hf_config import arch_from_hf
    from megatron_rl.models.lora import LoraSettings, add_adapters
    from megatron_rl.parallel import ParallelConfig

    work = tmp_path_factory.mktemp("lora")
    base = make_tiny_hf("qwen3", work / "base", seed=4)
    arch = arch_from_hf(base)
    (model,) = build_model("actor", arch, ParallelConfig(), BuildOptions())
    load_hf([model], base, arch)
    adapters = add_adapters([model], LoraSettings(rank=4, alpha=8.0, targets=tuple(LORA["targets"])))
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for adapter in adapters.values():
            adapter.b.copy_(torch.randn(adapter.b.shape, generator=g) * 0.1)
    tokens = torch.randint(0, arch.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    with platform.megatron_scope():
        logits = model(tokens, torch.arange(10).expand_as(tokens), None)[..., : arch.vocab_size].detach()
    extra = {"hf_config": json.loads((base / "config.json").read_text()), "hf_source_dir": str(base), "lora": LORA}
    adapters_only = {**LORA, "adapters_only": True, "base_digest": weights_digest(base)}  # as a LoRA run saves
    with checkpoint.Checkpointer() as ckpt:
        ckpt.save(work / "ckpt", 1, model=[model], extra=extra).wait()
        ckpt.save(work / "adapters", 1, model=[model], extra={**extra, "lora": adapters_only}, trainable_only=True)
        # the same adapters recording a base directory that now holds other weights
        other = make_tiny_hf("qwen3", work / "other", seed=5)
        elsewhere = {**extra, "lora": adapters_only, "hf_source_dir": str(other)}
        ckpt.save(work / "adapters_elsewhere", 1, model=[model], extra=elsewhere, trainable_only=True)
    return dict(work=work, base=base, other=other, tokens=tokens, logits=logits)


def assert_close(got, want, what):
    scale = want.abs().max().item()
    error = (got - want).abs().max().item()
    assert error <= RELATIVE_TOL * scale, f"{what}: {error:.3g} of a scale {scale:.3g}"


def hf_model(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()


def test_the_peft_adapter_computes_megatrons_logits_with_the_adapters(lora_run):
    from peft import PeftModel

    out = lora_run["work"] / "peft"
    assert main(["megatron-to-hf", "--ckpt", str(lora_run["work"] / "ckpt"), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    base = hf_model(lora_run["base"])
    with torch.no_grad():
        plain = base(input_ids=lora_run["tokens"]).logits
        adapted = PeftModel.from_pretrained(base, out).eval()(input_ids=lora_run["tokens"]).logits
    assert_close(adapted, lora_run["logits"], "base + PEFT adapter")
    assert (plain - lora_run["logits"]).abs().max() > 100 * RELATIVE_TOL * lora_run["logits"].abs().max()


def test_the_merged_export_computes_the_same_logits(lora_run):
    out = lora_run["work"] / "merged"
    assert main(["megatron-to-hf", "--ckpt", str(lora_run["work"] / "ckpt"), "--out", str(out), "--merge"]) == 0
    with torch.no_grad():
        logits = hf_model(out)(input_ids=lora_run["tokens"]).logits
    assert_close(logits, lora_run["logits"], "merged HF model")


def test_a_lora_runs_checkpoint_holds_the_adapters_only(lora_run):
    from megatron_rl.checkpoint.format import read_metadata
    from megatron_rl.models.adapter_names import is_adapter_name

    names = [n for n in read_metadata(lora_run["work"] / "adapters", 1).tensors if not n.startswith("optimizer.")]
    full = [n for n in read_metadata(lora_run["work"] / "ckpt", 1).tensors if not n.startswith("optimizer.")]
    assert names and all(is_adapter_name(n) for n in names)
    assert sorted(names) == sorted(n for n in full if is_adapter_name(n))


@pytest.mark.parametrize("merge", [False, True], ids=["peft", "merged"])
def test_an_adapters_only_checkpoint_exports_as_the_full_one(lora_run, merge):
    from peft import PeftModel

    out = lora_run["work"] / f"from_adapters_{merge}"
    argv = ["megatron-to-hf", "--ckpt", str(lora_run["work"] / "adapters"), "--out", str(out)]
    assert main(argv + (["--merge"] if merge else [])) == 0
    with torch.no_grad():
        if merge:  # the base from the HF directory the run recorded, the adapters folded in
            logits = hf_model(out)(input_ids=lora_run["tokens"]).logits
        else:
            adapted = PeftModel.from_pretrained(hf_model(lora_run["base"]), out).eval()
            logits = adapted(input_ids=lora_run["tokens"]).logits
    assert_close(logits, lora_run["logits"], "export of the adapters-only checkpoint")


def test_adapters_only_merge_and_resume_refuse_another_base_in_one_line(lora_run, tmp_path, capsys):
    from megatron_rl.config import ConfigError
    from megatron_rl.config.schema import LoraConfig
    from megatron_rl.from_config.adapter_checks import check_adapter_base

    other = lora_run["other"]  # the same architecture, other weights
    root = lora_run["work"] / "adapters"
    lora = LoraConfig(rank=4, alpha=8.0, targets=list(LORA["targets"]))
    check_adapter_base(root, 1, lora, lora_run["base"])  # its own base: nothing to say
    with pytest.raises(ConfigError, match="holds LoRA adapters of another base .*: resume with the base they"):
        check_adapter_base(root, 1, lora, other)
    with pytest.raises(ConfigError, match="holds LoRA adapters only .*: resume it with its model.lora section"):
        check_adapter_base(root, 1, None, lora_run["base"])
    elsewhere = lora_run["work"] / "adapters_elsewhere"
    assert main(["megatron-to-hf", "--ckpt", str(elsewhere), "--out", str(tmp_path / "out"), "--merge"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--merge needs the base they were trained on" in err[0], err


def test_the_merged_model_generates_the_greedy_tokens_of_the_peft_adapter(lora_run):
    from peft import PeftModel

    peft_dir, merged_dir = lora_run["work"] / "peft_greedy", lora_run["work"] / "merged_greedy"
    ckpt = str(lora_run["work"] / "adapters")
    assert main(["megatron-to-hf", "--ckpt", ckpt, "--out", str(peft_dir)]) == 0
    assert main(["megatron-to-hf", "--ckpt", ckpt, "--out", str(merged_dir), "--merge"]) == 0
    adapted = PeftModel.from_pretrained(hf_model(lora_run["base"]), peft_dir).eval()
    merged, base = hf_model(merged_dir), hf_model(lora_run["base"])
    moved = False
    prompts = torch.randint(0, 64, (16, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for prompt in prompts:
            want = adapted.generate(prompt[None], max_new_tokens=16, do_sample=False)
            assert merged.generate(prompt[None], max_new_tokens=16, do_sample=False).tolist() == want.tolist()
            moved |= base.generate(prompt[None], max_new_tokens=16, do_sample=False).tolist() != want.tolist()
    assert moved, "the adapters change no greedy token: the comparison could not fail"
