"""Every YAML in examples/ loads, validates and builds its recipe: the tiny CPU variants at
world 1, the cluster variants at 64 ranks against Qwen3-30B-A3B's published config.json,
with their reasoning-gym eval sets."""

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.algorithms.recipes import RECIPES
from megatron_rl.config import load_config
from megatron_rl.from_config import validate

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
TINY = sorted(p for p in EXAMPLES.glob("*.yaml") if p.stem in RECIPES)
CLUSTER = sorted((EXAMPLES / "cluster").glob("*.yaml"))


def test_every_recipe_has_a_tiny_and_a_cluster_variant():
    assert sorted(p.stem for p in TINY) == sorted(RECIPES)
    assert {p.stem.split("_")[0] for p in CLUSTER} == set(RECIPES)  # a recipe may have variants (dapo: _long)


@pytest.mark.parametrize("path", TINY, ids=lambda p: p.stem)
def test_tiny_variant_validates_on_one_rank(path):
    cfg = load_config(str(path), [])
    validate(cfg, 1)
    recipe = cfg.algorithm.build()
    assert recipe.name == path.stem and cfg.model.preset == "tiny-moe"
    assert cfg.data.source.startswith("task:")
    if recipe.overlong is not None:  # shaping sized to the tiny response budget, not 20K tokens
        assert recipe.overlong.max_len <= cfg.rollout.max_new_tokens


@pytest.mark.parametrize("path", CLUSTER, ids=lambda p: p.stem)
def test_cluster_variant_fits_qwen3_30b_a3b_on_64_gpus(path, tmp_path):
    shutil.copy(Path(__file__).parent / "data" / "qwen3_30b_a3b_config.json", tmp_path / "config.json")
    data = tmp_path / "math.parquet"  # validation reads the first rows of the prompt file
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2"}]), data)
    judges = [
        name
        for name, s in load_config(str(path), [f"model.hf_path={tmp_path}"]).reward.scorers.items()
        if s.kind == "judge"
    ]
    # a judge reads its own HF directory (its config and tokenizer: the checks look for both)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    # a teacher too: the model's own directory stands in for it (its shape fits the layout)
    teacher = [f"algorithm.teacher.path={tmp_path}"] if "opd" in path.stem else []
    cfg = load_config(
        str(path),
        [
            f"model.hf_path={tmp_path}",
            f"data.source={data}",
            *(f"reward.scorers.{j}.path={tmp_path}" for j in judges),
            *teacher,
        ],
    )
    validate(cfg, 64)
    recipe = cfg.algorithm.build()
    assert recipe.name == path.stem.split("_")[0]
    assert cfg.model.dtype == "bf16" and 64 % cfg.rollout.tensor_parallel_size == 0
    # The response budget fits the training sequence, which fits the model's positions.
    assert cfg.rollout.max_new_tokens < cfg.trainer.seq_length <= 40960
    # Held-out math from reasoning-gym (validate checked the datasets and their options).
    assert cfg.eval.enabled and cfg.eval.sets and all(spec.gym for spec in cfg.eval.sets.values()), cfg.eval
    assert (cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens) < cfg.trainer.seq_length
    with pytest.raises(Exception, match="world|divid|multiple"):
        validate(cfg, 60)  # 60 ranks do not fit TP2 x EP8
