"""Context parallelism: the zigzag split, config checks, and parity with one process.

Layer level (tests/helpers/dist_cp.py, one 4-rank world): a tiny decoder on each rank's zigzag slice gives
the single-process loss and gradients for cp = 2 and 4, both attention methods, with and without
document masks, with windowed kernels and learned positions; the two broken recipes (local RoPE
positions, a local loss mean) are far off.

Run level: whole training runs (5 steps, fp32, on short documents) under cp = 2, cp = 4,
cp = 2 x dp_shard = 2, cp = 2 x tp = 2 (with and without SP) and pp = 2 x cp = 2, each with both
methods, some with activation checkpointing, match the single-process run in loss, grad norm and
validation loss within 1e-5 relative; with document masks and EOD loss masks too (the pipeline
carries them from stage to stage). A checkpoint saved at cp = 2 resumes at cp = 1.

MoE (top-2 with aux + z losses; DeepSeek routing: sigmoid, per-sequence aux, aux-free bias) under
cp = 2 with both methods, cp = 2 x dp_shard = 2, x tp = 2 + SP and x pp = 2, and expert parallelism
over the cp ranks (cp = 2 x ep = 2, cp = 2 x dp_shard = 2 x ep = 2 and 4, cp = 2 x tp = 2 x ep = 4)
match one process in the same way, plus the logged aux/z losses and expert loads; a cp = 2 x ep = 2
checkpoint resumes at cp = 1.
At the layer level, a rank balancing its experts by its own counts only is far off. Also at cp = 2:
fp16 (against one fp16 process, FSDP's fp16 tolerances), torch.compile (with MoE), ALiBi (all-gather method,
document masks) and a masked-LM encoder with T5's relative bias; at the layer level a score bias
over the local keys only is far off.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from tessera.config import ConfigError
from tessera.validate import load_config
from tessera.parallel.context import zigzag_index
from tessera.train.trainer import train

from helpers.runs import assert_losses_close, assert_runs_match, step_records, torchrun, write_tiny_recipe

STEPS = 5
BASE = [
    f"train.steps={STEPS}",
    "train.batch_size=8",
    "log.every=1",
    "optim.schedule=constant",
    f"train.eval_every={STEPS}",
    "checkpoint.enabled=false",
]
DOCS = ["data.document_mask=true", "data.mask_eod_loss=true"]
RING = ["parallel.cp_method=ring"]

# MoE: top-2 with load-balancing and z losses; DeepSeek routing (sigmoid, per-sequence aux, aux-free bias).
# The per-rank balance loss ("micro"): dp2 references accumulate the ranks' halves (global: tests/integration).
MOE = [
    "model.moe.experts=4",
    "model.moe.ffn_hidden=64",
    "model.moe.aux_loss_coef=0.1",
    "model.moe.z_loss_coef=0.01",
    "model.moe.aux_loss_scope=micro",
]
DEEPSEEK = [
    *MOE[:3],
    "model.moe.router=sigmoid",
    "model.moe.aux_loss_scope=sequence",
    "model.moe.bias_update_rate=0.01",
    "model.moe.shared_experts=1",
]
# A masked-LM encoder (bidirectional) with T5's relative-position bias.
T5_ENCODER = [
    "model.arch=encoder",
    "model.objective=masked_lm",
    "model.vocab_size=520",
    "model.sentinel_tokens=8",
    "model.position.kind=t5_bias",
]
# Data parallelism averages each rank's mean token loss and MoE losses (as gradient accumulation averages
# micro-batches): its reference accumulates two micro-batches of the per-rank size. A pipeline's MoE losses
# are likewise per micro-batch.
DP2 = ["train.batch_size=4", "train.grad_accum=2", "train.eval_batches=4"]
REFERENCES = {
    "plain": [],
    "docs": DOCS,
    "docs_dp2": [*DOCS, *DP2],
    "moe": MOE,
    "moe_docs": [*MOE, *DOCS],
    "moe_dp2": [*MOE, *DP2],
    "moe_docs_dp2": [*MOE, *DOCS, *DP2],
    "deepseek": DEEPSEEK,
    "docs_fp16": [*DOCS, "train.dtype=fp16"],
    "alibi_docs": [*DOCS, "model.position.kind=alibi"],
    "t5_encoder": T5_ENCODER,
}
# fp16 runs match the single-process fp16 run as FSDP in fp16 does (tests/integration/test_precision.py): loss, grad norm.
FP16_TOLERANCE = (2e-5, 1e-3)

CP2 = ["parallel.cp=2", "parallel.dp_shard=1"]
SAVE_AT_3 = ["checkpoint.enabled=true", "checkpoint.every=3"]
CP2_FSDP2 = ["parallel.cp=2", "parallel.dp_shard=2"]
# name -> (overrides, reference)
WORLDS = {
    2: {
        "cp2": (CP2, "plain"),
        "cp2_ring_ac": ([*CP2, *RING, "parallel.activation_checkpoint=full"], "plain"),
        "cp2_docs": ([*CP2, *DOCS], "docs"),
        "cp2_ring_docs": ([*CP2, *RING, *DOCS, *SAVE_AT_3], "docs"),
        "cp2_moe": ([*CP2, *MOE], "moe"),
        "cp2_ring_moe_docs": ([*CP2, *RING, *MOE, *DOCS], "moe_docs"),
        "cp2_deepseek_ac": ([*CP2, *DEEPSEEK, "parallel.activation_checkpoint=full"], "deepseek"),
        "cp2_fp16_docs": ([*CP2, *DOCS, "train.dtype=fp16"], "docs_fp16"),
        "cp2_moe_docs_compile": ([*CP2, *MOE, *DOCS, "parallel.compile=true"], "moe_docs"),
        "cp2_alibi_docs": ([*CP2, *REFERENCES["alibi_docs"]], "alibi_docs"),
        "cp2_t5_encoder": ([*CP2, *T5_ENCODER], "t5_encoder"),
        "cp2_ep2_ring_moe_docs": ([*CP2, "parallel.ep=2", *RING, *MOE, *DOCS, *SAVE_AT_3], "moe_docs"),
    },
    4: {
        "cp4_docs_ac": (["parallel.cp=4", "parallel.dp_shard=1", *DOCS, "parallel.activation_checkpoint=op"], "docs"),
        "cp4_ring": (["parallel.cp=4", "parallel.dp_shard=1", *RING], "plain"),
        "cp2_fsdp2": (CP2_FSDP2, "plain"),
        "cp2_fsdp2_ring_docs": ([*CP2_FSDP2, *RING, *DOCS], "docs_dp2"),
        "cp2_tp2_sp_docs": ([*CP2, "parallel.tp=2", *DOCS], "docs"),
        "cp2_tp2_ring": ([*CP2, "parallel.tp=2", "parallel.sequence_parallel=false", *RING], "plain"),
        "pp2_cp2": ([*CP2, "parallel.pp=2"], "plain"),
        "pp2_cp2_ring_docs": ([*CP2, "parallel.pp=2", *RING, *DOCS], "docs"),
        "cp2_fsdp2_moe_docs": ([*CP2_FSDP2, *MOE, *DOCS], "moe_docs_dp2"),
        "cp2_fsdp2_ep2_moe_docs": ([*CP2_FSDP2, "parallel.ep=2", *MOE, *DOCS], "moe_docs_dp2"),
        "cp2_fsdp2_ep4_ring_moe_docs": ([*CP2_FSDP2, "parallel.ep=4", *RING, *MOE, *DOCS], "moe_docs_dp2"),
        "cp2_tp2_sp_moe": ([*CP2, "parallel.tp=2", *MOE], "moe"),
        "cp2_tp2_ep4_moe": ([*CP2, "parallel.tp=2", "parallel.ep=4", *MOE], "moe"),
        # MoE losses are per pipeline micro-batch (pp=2: 2 of 4 sequences), as per data-parallel rank
        "pp2_cp2_moe": ([*CP2, "parallel.pp=2", *MOE], "moe_dp2"),
    },
}


def _val_losses(run_dir) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["val_loss"] for r in map(json.loads, lines) if "val_loss" in r]


@pytest.fixture(scope="module")
def base_recipe(tmp_path_factory, cache_dir, small_tokenizer):
    """The tiny job on a corpus of short documents (3 to 40 words), so sequences hold several
    documents and the cp ranks hold different numbers of loss tokens under ``mask_eod_loss``."""
    root = tmp_path_factory.mktemp("cp")
    rng = random.Random(0)
    words = ["def", "return", "x", "f(x):", "*", "+", "'text'", "if", "else", "for", "in", "range(3):", "=", "1"]
    with open(root / "docs.jsonl", "w") as f:
        for _ in range(1500):
            f.write(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(3, 40)))}) + "\n")
    corpus = [f"data.source={root / 'docs.jsonl'}", f"data.tokenizer={small_tokenizer}"]
    return write_tiny_recipe(root / "base.toml", cache_dir, *BASE, *corpus)


@pytest.fixture(scope="module")
def references(base_recipe, tmp_path_factory):
    """Single-process runs of :data:`REFERENCES`, each trained on first use (cp is exact within each
    data-parallel rank's batch)."""
    out = tmp_path_factory.mktemp("cp_refs")
    runs = {}

    def run(name: str):
        if name not in runs:
            config = load_config(base_recipe, [*REFERENCES[name], f"train.run_dir={out}/{name}"])
            runs[name] = train(config).run_dir
        return runs[name]

    return run


def test_zigzag_split_balances_causal_work_and_covers_the_sequence():
    parts = [zigzag_index(16, 4, r) for r in range(4)]
    assert parts[0].tolist() == [0, 1, 14, 15] and parts[3].tolist() == [6, 7, 8, 9]
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(16))
    work = [int((p + 1).sum()) for p in parts]  # causal attention: query i scores i + 1 keys
    assert len(set(work)) == 1


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.cp=2", "train.seq_len=30"], "divisible by 2 x parallel.cp=4"),
        (["parallel.cp=2", "parallel.cp_method=ring", "model.attention.dropout=0.1"], "without dropout"),
        (["parallel.cp=2", "parallel.tp=4", "model.n_kv_heads=4", "train.seq_len=36"], "tp=4 x parallel.cp=2"),
        (
            ["parallel.cp=2", "model.attention.kernel=linear", "model.arch=encoder", "model.sentinel_tokens=1"],
            "causal only",
        ),
        (["parallel.cp=2", "parallel.cp_method=ring", "model.position.kind=alibi"], "adds no score bias"),
        (["parallel.cp=2", "model.moe.experts=4", "model.moe.capacity_factor=1.25"], "token dropping\\) with cp"),
        (["parallel.cp=2", "parallel.cp_method=zigzag"], "parallel.cp_method"),
    ],
)
def test_context_parallel_config_errors_name_the_fix(tiny_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(*overrides)


def test_layer_level_parity_and_negative_controls(tmp_path):
    torchrun(4, "tests/helpers/dist_cp.py", str(tmp_path / "cp.json"))
    cases = json.loads((tmp_path / "cp.json").read_text())
    bugs = {name: errors for name, errors in cases.items() if name.startswith("bug_")}
    for name, errors in cases.items():
        if name not in bugs:
            assert max(errors.values()) < 1e-5, (name, errors)
    assert max(bugs["bug_local_positions"].values()) > 1e-2  # RoPE must use global positions
    assert max(bugs["bug_local_mean"].values()) > 1e-2  # the loss must be normalized by the global token count
    assert max(bugs["bug_local_expert_counts"].values()) > 1e-2  # MoE balancing must count every rank's tokens
    assert max(bugs["bug_local_bias_keys"].values()) > 1e-2  # ALiBi/T5 bias over the gathered keys' positions
    assert max(bugs["bug_sink_per_rank"].values()) > 1e-2  # attention sinks enter each softmax once, not per rank
    assert max(bugs["bug_recurrent_no_state"].values()) > 1e-2  # Mamba-2 / elu+1 state crosses the ranks
    assert max(bugs["bug_recurrent_no_halo"].values()) > 1e-2  # the convolution window reaches the rank before
    assert sum(name.startswith(("cp2_recurrent", "cp4_recurrent")) for name in cases) == 8


@pytest.mark.slow
@pytest.mark.parametrize("world", list(WORLDS))
def test_training_matches_single_process(world, base_recipe, references, tmp_path):
    variants = {name: overrides for name, (overrides, _) in WORLDS[world].items()}
    torchrun(world, "tests/helpers/dist_variants.py", str(base_recipe), str(tmp_path), json.dumps(variants))
    for name, (_, reference) in WORLDS[world].items():
        if reference.endswith("fp16"):
            _assert_fp16_close(tmp_path / name, references(reference))
            fp32 = [r["grad_norm"] for r in step_records(references(reference.removesuffix("_fp16")))]
            assert [r["grad_norm"] for r in step_records(tmp_path / name)] != fp32  # autocast was in effect
            continue
        assert assert_runs_match(tmp_path / name, references(reference)) == STEPS  # losses, grad norms, parameters
        assert_losses_close(_val_losses(tmp_path / name), _val_losses(references(reference)), what="validation loss")
        if "moe" in reference or "deepseek" in reference:  # logged router metrics are the whole batch's
            _assert_moe_metrics_match(tmp_path / name, references(reference))
    if world == 2:  # checkpoints of step 3 at cp=2 (and cp=2 x ep=2) continue at cp=1 on the reference curve
        for name, reference in (("cp2_ring_docs", "docs"), ("cp2_ep2_ring_moe_docs", "moe_docs")):
            step3 = tmp_path / name / "checkpoints" / "step_00000003"
            overrides = [*REFERENCES[reference], f"train.resume={step3}", f"train.run_dir={tmp_path}/{name}_resumed"]
            run = train(load_config(base_recipe, overrides)).run_dir
            assert assert_runs_match(run, references(reference), after=3) == STEPS - 3


def _assert_fp16_close(run_dir, reference_dir) -> None:
    """Loss and grad norm per step within :data:`FP16_TOLERANCE` (the same steps skipped on overflow)."""
    got, want = step_records(run_dir), step_records(reference_dir)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for key, rtol in zip(("loss", "grad_norm"), FP16_TOLERANCE):
        assert_losses_close([r[key] for r in got], [r[key] for r in want], rtol, what=key)


def _assert_moe_metrics_match(run_dir, reference_dir) -> None:
    """moe_aux_loss, moe_z_loss and the expert load per step, as one process logs them."""
    got, want = (
        [r for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if "moe_aux_loss" in r]
        for d in (run_dir, reference_dir)
    )
    assert len(got) == len(want) == STEPS
    for key in ("moe_aux_loss", "moe_z_loss"):
        assert_losses_close([r[key] for r in got], [r[key] for r in want], what=key)
    assert [r["moe_expert_load"] for r in got] == [r["moe_expert_load"] for r in want]
