"""Feature x layout cells of the compatibility table, each proven by parity with one process
(fp32, 1e-5 relative on loss and grad norm per step, and the final parameters), 5 steps.

One torchrun world of 2 ranks trains every tensor-parallel variant; each has a single-process
reference with the same overrides.
"""

from __future__ import annotations

import json

import pytest

from tessera.validate import load_config
from tessera.train.trainer import train

from helpers.runs import assert_runs_match, torchrun, write_tiny_recipe

BASE = [
    "train.steps=5",
    "train.batch_size=4",
    "log.every=1",
    "optim.schedule=constant",
    "train.eval_every=0",
    "checkpoint.enabled=false",
]
BERT = [
    "model.arch=encoder",
    "model.sentinel_tokens=1",
    "model.position.kind=learned",
    "model.norm_position=post",
    "model.embed_norm=true",
    "model.type_vocab_size=2",
    "model.norm=layernorm",
    "model.bias=true",
    "model.attention.qkv_bias=true",
    "model.tie_embeddings=true",
    "model.activation=gelu",
]
T5 = [
    "model.arch=encoder_decoder",
    "model.position.kind=t5_bias",
    "model.sentinel_tokens=8",
    "model.attention.scale=1.0",
    "model.n_decoder_layers=1",
]
TP2 = ["parallel.dp_shard=1", "parallel.tp=2"]

# name -> the model/feature overrides; each runs under TP=2 with SP (and a few without)
TP_VARIANTS = {
    "compile": ["parallel.compile=true"],
    "tied": ["model.tie_embeddings=true"],
    "learned_positions": ["model.position.kind=learned"],
    "sinusoidal_positions": ["model.position.kind=sinusoidal"],
    "alibi": ["model.position.kind=alibi"],
    "bigbird": ["model.attention.kernel=bigbird", "model.attention.block_size=8", "model.attention.global_tokens=2"],
    "longformer": ["model.attention.kernel=longformer", "model.attention.sliding_window=8"],
    "linear": ["model.attention.kernel=linear"],
    "bert": BERT,
    "t5": T5,
}
NO_SP = {"bert_no_sp", "t5_no_sp", "tied_no_sp"}


def _variant(name: str) -> list[str]:
    base = name.removesuffix("_no_sp")
    return [*TP_VARIANTS[base], *(["parallel.sequence_parallel=false"] if name in NO_SP else [])]


@pytest.mark.slow
def test_tensor_and_sequence_parallel_cover_every_model_feature(tmp_path, cache_dir):
    recipe = write_tiny_recipe(tmp_path / "job.toml", cache_dir, *BASE)
    names = [*TP_VARIANTS, *sorted(NO_SP)]
    refs = {}
    for name in names:
        overrides = [o for o in _variant(name) if not o.startswith("parallel.")]
        refs[name] = train(load_config(recipe, [*overrides, f"train.run_dir={tmp_path}/ref_{name}"])).run_dir
    variants = {name: [*TP2, *_variant(name)] for name in names}
    torchrun(2, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(variants))
    failures = []
    for name in names:
        try:
            assert_runs_match(tmp_path / name, refs[name])
        except AssertionError as err:
            failures.append(f"{name}: {str(err).splitlines()[0]}")
    assert not failures, "\n".join(failures)


# name -> (parallel overrides on 4 ranks, feature overrides shared with its one-process reference)
PIPELINE_AND_DDP = {
    "ddp2_tp2": (["parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.tp=2"], []),
    "ddp2_pp2": (["parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.pp=2", "parallel.microbatches=2"], []),
    "pp2_fsdp2_compile": (
        ["parallel.pp=2", "parallel.dp_shard=2", "parallel.microbatches=2"],
        ["parallel.compile=true"],
    ),
    # With only whole (or replicated) parameters, meta init draws exactly the one-process weights.
    "ddp2_pp2_meta": (
        ["parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.pp=2", "parallel.microbatches=2"],
        ["parallel.meta_init=true"],
    ),
    "pp2_fsdp2_documents": (
        ["parallel.pp=2", "parallel.dp_shard=2", "parallel.microbatches=2"],
        ["data.document_mask=true", "data.mask_eod_loss=true", "train.label_smoothing=0.1"],
    ),
    # Parameters used by stages on several pp ranks: gradients summed over those ranks, counted once.
    "pp2_fsdp2_tied": (
        ["parallel.pp=2", "parallel.dp_shard=2", "parallel.microbatches=2"],
        ["model.tie_embeddings=true", "checkpoint.enabled=true"],
    ),
    "pp4_tied": (
        ["parallel.pp=4", "parallel.dp_shard=1", "parallel.microbatches=4"],
        ["model.tie_embeddings=true", "model.n_layers=4"],
    ),
    "pp2_fsdp2_t5_bias": (
        ["parallel.pp=2", "parallel.dp_shard=2", "parallel.microbatches=2"],
        ["model.position.kind=t5_bias"],
    ),
    # Recurrent mixers' per-rank parameter slices (tessera/parallel/recurrent.py) read FSDP's unsharded parameters.
    "fsdp2_tp2_gated_deltanet": (
        ["parallel.dp_shard=2", "parallel.tp=2"],
        ["model.layer_pattern=DA", "model.gdn.key_heads=2", "model.gdn.value_heads=4", "model.gdn.chunk=8"],
    ),
    "cp2_tp2_sp_mamba2_linear": (
        ["parallel.cp=2", "parallel.dp_shard=1", "parallel.tp=2", "parallel.sequence_parallel=true"],
        [
            "model.layer_pattern=MA",
            "model.mamba.version=2",
            "model.mamba.head_dim=16",
            "model.mamba.groups=2",
            "model.mamba.chunk=8",
            "model.attention.kernel=linear",
        ],
    ),
}


@pytest.mark.slow
def test_pipeline_and_data_parallel_cells(tmp_path, cache_dir):
    recipe = write_tiny_recipe(tmp_path / "job.toml", cache_dir, *BASE)
    refs = {}
    for name, (_, features) in PIPELINE_AND_DDP.items():
        single = [f for f in features if not f.startswith("parallel.")]
        refs[name] = train(load_config(recipe, [*single, f"train.run_dir={tmp_path}/ref_{name}"])).run_dir
    variants = {name: [*layout, *features] for name, (layout, features) in PIPELINE_AND_DDP.items()}
    torchrun(4, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(variants))
    for name in PIPELINE_AND_DDP:
        assert assert_runs_match(tmp_path / name, refs[name]) == 5, name
    # The tied pipeline's checkpoint (step 5) resumes on one process: same steps 6-7 as an unsplit run.
    tied = ["model.tie_embeddings=true", "checkpoint.enabled=true", "train.steps=7"]
    longer = train(load_config(recipe, [*tied, "checkpoint.every=5", f"train.run_dir={tmp_path}/ref_tied7"])).run_dir
    train(load_config(recipe, [*tied, f"train.run_dir={tmp_path}/pp2_fsdp2_tied"]))
    assert assert_runs_match(tmp_path / "pp2_fsdp2_tied", longer, after=5) == 2


T5_RECIPE = "configs/tiny/t5.toml"  # 2 encoder + 2 decoder blocks, tied embeddings, T5 relative bias
T5_STEPS = [*BASE, "train.seq_len=32", "model.max_seq_len=64", "optim.warmup_steps=2", "train.sample_tokens=0"]
T5_PP2 = ["parallel.pp=2", "parallel.dp_shard=1", "parallel.microbatches=2"]
# world size -> name -> (layout, feature overrides shared with its one-process reference). Span corruption
# draws each sequence's noise from that sequence alone, so a data-parallel split keeps the masks.
T5_PIPELINES = {
    2: {
        "pp2": (T5_PP2, []),  # encoder | decoder: the memory crosses one stage boundary
        "pp2_interleaved": ([*T5_PP2, "parallel.pp_schedule=interleaved_1f1b"], []),  # one block per stage
        "pp2_split13": ([*T5_PP2, "parallel.layers_per_stage=1,3"], []),  # a stage ends the encoder, runs the decoder
    },
    4: {
        "pp4": (["parallel.pp=4", "parallel.dp_shard=1", "parallel.microbatches=4"], []),
        # The tied embedding's vocab shards: its gradient on the encoder's stage comes back replicated.
        "pp2_tp2": ([*T5_PP2[:2], "parallel.tp=2", "parallel.microbatches=2"], []),
        "pp2_fsdp2": (["parallel.pp=2", "parallel.dp_shard=2", "parallel.microbatches=2"], []),
    },
}


@pytest.mark.slow
def test_encoder_decoder_trains_under_pipeline_parallelism(tmp_path, cache_dir):
    """Decoder token ids ride through the encoder stages, the memory through the decoder stages
    (its gradient flows back into the encoder), the tied embedding is summed over its stages."""
    recipe = tmp_path / "t5.toml"
    recipe.write_text(load_config(T5_RECIPE, [*T5_STEPS, f"data.cache_dir={cache_dir}"]).to_toml())
    refs = {}
    for world, variants in T5_PIPELINES.items():
        for name, (_, features) in variants.items():
            key = tuple(features)
            if key not in refs:
                refs[key] = train(load_config(recipe, [*features, f"train.run_dir={tmp_path}/ref{len(refs)}"])).run_dir
        runs = {name: [*layout, *features] for name, (layout, features) in variants.items()}
        torchrun(world, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(runs))
    for variants in T5_PIPELINES.values():
        for name, (_, features) in variants.items():
            assert assert_runs_match(tmp_path / name, refs[tuple(features)]) == 5, name
