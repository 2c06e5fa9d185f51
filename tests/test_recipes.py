"""Recipes: full-size parameter counts match the published models; every tiny recipe trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tessera.config import load_config
from tessera.model import build_model, count_parameters
from tessera.train.trainer import train

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

# Published parameter counts (HF transformers' models of the same configs count the same).
PUBLISHED = {
    "gpt2-124m": 124_439_808,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "bert-base": 109_514_298,  # BertForMaskedLM: encoder + MLM head, no pooler
    "t5-base": 222_903_552,
    # DeepSeekMoE 16B ("16.4B"): embeddings 2 x 102400 x 2048, 28 x (attention 4 x 2048^2 + 2 norms), a dense
    # first FFN 3 x 2048 x 10944, 27 x (64 experts + 2 shared experts of 3 x 2048 x 1408, router 64 x 2048).
    "deepseek-moe-16b": 16_375_728_128,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_full_recipe_parameter_count(name):
    config = load_config(CONFIGS / f"{name}.toml")
    with torch.device("meta"):
        model = build_model(config.model)
    assert count_parameters(model) == PUBLISHED[name]


TINY = sorted(p.stem for p in (CONFIGS / "tiny").glob("*.toml"))


def test_every_family_has_a_tiny_recipe():
    assert set(TINY) >= {"llama", "mistral", "qwen2", "gpt2", "mixtral", "bert", "t5"}


@pytest.mark.parametrize("family", TINY)
def test_tiny_recipe_trains(family, tmp_path, cache_dir):
    overrides = [
        f"train.run_dir={tmp_path / 'run'}", f"data.cache_dir={cache_dir}", "train.steps=30", "train.eval_every=0",
        "train.eval_batches=1", "train.sample_tokens=0", "checkpoint.enabled=false", "log.progress=none",
        "log.tensorboard=false", "log.plot=false", "log.peak_flops=1e12",
    ]
    result = train(load_config(CONFIGS / "tiny" / f"{family}.toml", overrides))
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < first - 0.5, f"{family}: loss {first:.3f} -> {last:.3f}"
    if family == "mixtral":  # the trainer logs the MoE losses and expert load
        records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert all(r["moe_aux_loss"] > 0 and r["moe_imbalance"] >= 1 for r in records if "loss" in r)
