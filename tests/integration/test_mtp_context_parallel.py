"""Multi-token prediction under context parallelism: the tiny DeepSeek-V3 recipe (MLA, MoE) with two MTP
depths at cp2, all-gather and ring attention, with and without document masks, matches one process on
losses, grad norms and final parameter norms (fp32, 1e-5)."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.model.mtp import mtp_ahead, mtp_targets
from tessera.parallel.context import zigzag_index
from tessera.train.trainer import train
from tessera.validate import load_config

from helpers.runs import TINY_OVERRIDES, assert_runs_match, torchrun

STEPS = 3
OVERRIDES = [
    "model.mtp_depth=2",
    "train.mtp_loss_weight=0.5",
    f"train.steps={STEPS}",
    "train.batch_size=2",
    "train.seq_len=32",
    "train.eval_every=0",
    "train.dtype=fp32",
    "optim.schedule=constant",
    "checkpoint.enabled=false",
    "log.every=1",
]


def test_the_split_targets_are_the_whole_sequences_targets_at_each_ranks_positions():
    tokens = torch.randint(0, 50, (2, 16))
    labels, mask = tokens.roll(-1, 1), torch.rand(2, 16) > 0.3
    ahead = mtp_ahead(tokens, labels, mask, 2)
    for rank in range(2):
        index = zigzag_index(16, 2, rank)
        for depth in (1, 2):
            want_labels, want_mask = mtp_targets(labels, mask, depth)
            assert torch.equal(ahead["mtp_labels"][:, index, depth - 1], want_labels[:, index])
            assert torch.equal(ahead["mtp_mask"][:, index, depth - 1], want_mask[:, index])
            assert torch.equal(ahead["mtp_tokens"][:, index, depth - 1], tokens.roll(-depth, 1)[:, index])


@pytest.mark.slow
@pytest.mark.parametrize("documents", [False, True], ids=["packed", "document_mask"])
def test_deepseek_v3_mtp_at_cp2_matches_one_process(tmp_path, cache_dir, documents):
    extra = ["data.document_mask=true"] if documents else []
    tiny = [o for o in TINY_OVERRIDES if not o.startswith(("model.n_layers", "model.n_kv_heads"))]
    config = load_config("configs/tiny/deepseek_v3.toml", [*tiny, f"data.cache_dir={cache_dir}", *OVERRIDES, *extra])
    recipe = tmp_path / "base.toml"
    recipe.write_text(config.to_toml())
    reference = train(load_config(recipe, [f"train.run_dir={tmp_path}/ref"])).run_dir
    variants = {
        "cp2": ["parallel.dp_shard=1", "parallel.cp=2"],
        "cp2_ring": ["parallel.dp_shard=1", "parallel.cp=2", "parallel.cp_method=ring"],
    }
    torchrun(2, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(variants))
    for name in variants:
        assert assert_runs_match(tmp_path / name, reference) == STEPS, name
