"""Latent attention (a tiny DeepSeek-V3 recipe: MLA with a query bottleneck, sigmoid-routed experts),
QK-norm over all heads (an OLMo 2-style dense decoder) and DeepSeek Sparse Attention (the V3 recipe plus
a lightning indexer, top-k global over the sequence; under tp2 and cp2) under tensor, sequence, expert and context
parallelism, and a Gemma 3-shaped decoder (local/global layers with their own RoPE, sandwich norms) under
tp2 + SP, cp2 (windows crossing the ranks' boundary) and pp2, match the single-process run: losses and grad
norms per step and the final parameters
(fp32, 1e-5 relative). One 2-process world trains every layout (tests/helpers/dist_variants.py)."""

from __future__ import annotations

import json

import pytest

from tessera.train.trainer import train
from tessera.validate import load_config

from helpers.runs import REPO, assert_runs_match, torchrun

STEPS = 3
SHORT = [
    f"train.steps={STEPS}",
    "train.batch_size=4",
    "train.seq_len=32",
    "train.eval_every=0",
    "train.sample_tokens=0",
    "optim.schedule=constant",
    "optim.warmup_steps=0",
    "checkpoint.enabled=false",
    "log.every=1",
    "log.progress=none",
    "log.tensorboard=false",
    "log.plot=false",
    "model.n_layers=2",  # one dense layer, one MoE layer
]
# OLMo 2: dense, RMSNorm over the whole q and k projections (not per head), GQA.
OLMO2 = [
    "model.mla.kv_rank=0",
    "model.mla.q_rank=0",
    "model.moe.experts=0",
    "model.n_kv_heads=2",
    "model.attention.qk_norm=true",
    "model.attention.qk_norm_scope=all",
]
# DeepSeek-V3.2: each query attends to the 8 keys (of up to 32) an 8-head lightning indexer picks
# (enough heads that no two keys tie at an all-zero score: ties break by key order, which cp permutes).
DSA = ["model.dsa.topk=8", "model.dsa.index_heads=8", "model.dsa.index_head_dim=16"]
# Gemma 3's shape: a local layer (8-token windows, RoPE base 1e4: windows cross the cp ranks' halves) and a global
# one (1e6), sandwich norms of gain 1 + w, per-head QK-norm, GeGLU, sqrt(dim) embeddings, a tied soft-capped head.
GEMMA3 = [
    *OLMO2[:4],
    "model.layer_pattern=AG",
    "model.attention.sliding_window=8",
    "model.attention.qk_norm=true",
    "model.position.rope_theta=1000000",
    "model.position.local_rope_theta=10000",
    "model.norm=zero_centered_rmsnorm",
    "model.norm_position=sandwich",
    "model.embed_scale=true",
    "model.activation=geglu",
    "model.tie_embeddings=true",
    "model.logit_softcap=30",  # through the fused head + loss (vocab-parallel under tp)
]
ONE_RANK = ["parallel.dp_shard=1"]
LAYOUTS = {
    "mla_tp2_sp": [*ONE_RANK, "parallel.tp=2", "parallel.sequence_parallel=true"],
    "mla_ep2_tp2": [*ONE_RANK, "parallel.tp=2", "parallel.ep=2"],
    "mla_cp2_allgather": [*ONE_RANK, "parallel.cp=2", "parallel.cp_method=allgather"],
    "mla_cp2_ring": [*ONE_RANK, "parallel.cp=2", "parallel.cp_method=ring"],
    "olmo2_tp2_sp": [*OLMO2, *ONE_RANK, "parallel.tp=2", "parallel.sequence_parallel=true"],
    "dsa_cp2_allgather": [*DSA, *ONE_RANK, "parallel.cp=2", "parallel.cp_method=allgather"],  # global top-k
    "gemma3_tp2_sp": [*GEMMA3, *ONE_RANK, "parallel.tp=2", "parallel.sequence_parallel=true"],
    "gemma3_cp2_ring": [*GEMMA3, *ONE_RANK, "parallel.cp=2", "parallel.cp_method=ring"],
    "gemma3_pp2": [*GEMMA3, *ONE_RANK, "parallel.pp=2", "parallel.microbatches=2"],
    # heads split, the indexer replicated: the same global top-k on both ranks, its KL target over all heads
    "dsa_tp2": [*DSA, *ONE_RANK, "parallel.tp=2", "parallel.sequence_parallel=false"],
    "dsa_tp2_sp": [*DSA, *ONE_RANK, "parallel.tp=2", "parallel.sequence_parallel=true"],
}


@pytest.mark.slow
def test_latent_attention_and_all_heads_qk_norm_layouts_match_one_process(tmp_path, cache_dir):
    recipe = tmp_path / "deepseek_v3.toml"
    base = load_config(REPO / "configs/tiny/deepseek_v3.toml", [*SHORT, f"data.cache_dir={cache_dir}"])
    recipe.write_text(base.to_toml())
    references = {
        "mla": train(load_config(recipe, [f"train.run_dir={tmp_path}/mla_single"])).run_dir,
        "olmo2": train(load_config(recipe, [*OLMO2, f"train.run_dir={tmp_path}/olmo2_single"])).run_dir,
        "dsa": train(load_config(recipe, [*DSA, f"train.run_dir={tmp_path}/dsa_single"])).run_dir,
        "gemma3": train(load_config(recipe, [*GEMMA3, f"train.run_dir={tmp_path}/gemma3_single"])).run_dir,
    }
    torchrun(2, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(LAYOUTS))
    for name in LAYOUTS:
        reference = references[name.split("_")[0]]
        assert assert_runs_match(tmp_path / name, reference) == STEPS, name
