"""The planner's pure formulas against hand-computed examples and against what autograd saves."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tessera.config import ModelConfig
from tessera.validate import load_config
from tessera.model import build_model, count_parameters
from tessera.model.moe import MoELog
from tessera.plan.activations import Precision, korthikanti_block, korthikanti_table2, tessera_block, tessera_precision
from tessera.plan.gpus import GIB, LATENCY_NVLINK, LINK_EFFICIENCY, gpu
from tessera.plan.layouts import Layout
from tessera.plan.memory import inflight_stages, zero_model_state_bytes
from tessera.plan.shapes import model_shape
from tessera.plan.speed import estimate_speed, ring_time

P, N = 1_000_000_000, 8


def test_zero_stages_match_the_zero_paper():
    """Mixed-precision Adam: 16P, 4P + 12P/N, 2P + 14P/N, 16P/N; tessera's fp32-master variant of ZeRO-3: 16P/N."""
    assert zero_model_state_bytes(P, N, 0) == 16e9
    assert zero_model_state_bytes(P, N, 1) == 4e9 + 12e9 / 8
    assert zero_model_state_bytes(P, N, 2) == 2e9 + 14e9 / 8
    assert zero_model_state_bytes(P, N, 3) == 2e9
    assert zero_model_state_bytes(P, N, 3, param_bytes=4, grad_bytes=4, optim_bytes=8) == 2e9
    assert zero_model_state_bytes(P, N, 0, param_bytes=4, grad_bytes=4, optim_bytes=8) == 16e9


# GPT-3 175B-like block: s=2048, b=1, h=12288, a=96, t=8; sbh = 25,165,824 and 5as/h = 80.
KORTHIKANTI = {
    "none": 114 * 25_165_824,  # sbh (34 + 80)
    "tp": 23 * 25_165_824,  # sbh (10 + 24/8 + 80/8)
    "tp_sp": 114 * 25_165_824 // 8,  # sbh/t (34 + 80)
    "tp_sp_selective": 34 * 25_165_824 // 8,
    "full": 2 * 25_165_824,
}


@pytest.mark.parametrize("mode", list(KORTHIKANTI))
def test_korthikanti_table2_by_hand_and_by_the_block_accounting(mode):
    """Table 2 of Korthikanti et al. 2022 equals a hand computation, and the per-tensor split reproduces it."""
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    assert korthikanti_table2(s, b, h, a, t if mode != "none" else 1, mode) == KORTHIKANTI[mode]
    block = korthikanti_block(h, a)
    full, selective = block.full, dataclasses.replace(block.full, scores=0.0)
    generic = {
        "none": full.bytes(s * b, s),
        "tp": full.bytes(s * b, s, t),
        "tp_sp": full.bytes(s * b, s, t, sp=True, megatron_sp=True),
        "tp_sp_selective": selective.bytes(s * b, s, t, sp=True, megatron_sp=True),
        "full": block.checkpointed.bytes(s * b, s),
    }[mode]
    assert generic == pytest.approx(KORTHIKANTI[mode])


def test_inflight_micro_batches_of_each_schedule():
    """1F1B: rank r holds p - r micro-batches; interleaved: Korthikanti's L(1 + (p-1)/(pv)) on the first stage;
    GPipe: all m."""
    p, v, m = 8, 4, 32
    one_f = Layout(pp=p, microbatches=m)
    assert [inflight_stages(one_f, r) for r in (0, 3, p - 1)] == [8, 5, 1]
    interleaved = Layout(pp=p, schedule="interleaved_1f1b", virtual=v, microbatches=m)
    # in units of the rank's L/p layers: p (1 + (p - 1) / (p v)) = 8 + 7/4
    assert inflight_stages(interleaved, 0) == pytest.approx(p * (1 + (p - 1) / (p * v)))
    assert inflight_stages(Layout(pp=p, schedule="gpipe", microbatches=m), 0) == m
    assert inflight_stages(Layout(pp=p, microbatches=3), 0) == 3  # fewer micro-batches than stages


def test_ring_collective_times():
    """A ring all-reduce moves 2(n-1)/n of the tensor; all-gather (n-1)/n; each pays one latency."""
    link = (100e9, 1e-5)
    assert ring_time("all_reduce", 8e9, 8, link) == pytest.approx(2 * 7 / 8 * 8e9 / 100e9 + 1e-5)
    assert ring_time("all_gather", 8e9, 8, link) == pytest.approx(7 / 8 * 8e9 / 100e9 + 1e-5)
    assert ring_time("all_reduce", 8e9, 1, link) == 0.0


def _tiny(**model) -> ModelConfig:
    base = {"vocab_size": 512, "dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 128}
    return ModelConfig(**{**base, **model})


def test_flops_per_token_is_6n_plus_attention_with_only_active_experts():
    """6 N_matmul + 6 L H Q (T + 1) (causal: T (T + 1) / 2 pairs; norms are not matmuls); an MoE layer
    counts top_k of its experts."""
    dense = model_shape(_tiny())
    n = count_parameters(build_model(_tiny()), exclude_embeddings=True)
    assert dense.active_matmul == n
    norms = 4 * 2 * 64 + 64
    assert dense.flops_per_token(32) == 6 * (n - norms) + 6 * 4 * 64 * 33
    cfg = dataclasses.replace(_tiny(), moe=dataclasses.replace(ModelConfig().moe, experts=4, top_k=2, ffn_hidden=96))
    moe = model_shape(cfg)
    experts = sum(b.experts for b in moe.blocks)
    assert experts == 4 * 4 * 3 * 64 * 96
    assert moe.active_matmul == count_parameters(build_model(cfg), exclude_embeddings=True) - experts // 2


@pytest.mark.parametrize(
    "recipe", ["tiny/llama", "tiny/gpt2", "tiny/mixtral", "tiny/bert", "tiny/t5", "llama3-8b", "mixtral-8x7b"]
)
def test_parameter_counts_equal_the_built_model(recipe):
    """The planner's per-block counts add up to the real model's parameters (full-size recipes on meta)."""
    cfg = load_config(f"configs/{recipe}.toml").model
    with torch.device("meta"):
        expected = count_parameters(build_model(cfg))
    assert model_shape(cfg).total == expected


def _saved_bytes(cfg: ModelConfig, mode: str, tokens: tuple[int, int] = (3, 20)) -> float:
    """Bytes autograd saves for one block's backward, per token (parameters and RoPE tables excluded)."""
    torch.manual_seed(0)
    model = build_model(cfg)
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    block = model.layers["0"]
    b, t = tokens
    x = torch.randn(b, t, cfg.dim, requires_grad=True, dtype=torch.bfloat16 if mode == "bf16" else torch.float32)
    ctx = model.context(b, t, 0, None, None, x.device)
    ctx.moe_log = MoELog()
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {c.untyped_storage().data_ptr() for c in (ctx.cos, ctx.sin) if c is not None}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = tensor.untyped_storage().nbytes()
        return tensor

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast:
        block(x, ctx)
    casts = 0
    if mode == "autocast":  # autocast's weight copies are parameters in disguise: the planner counts them as buffers
        casts = sum(2 * p.numel() for n, p in block.named_parameters() if p.dim() >= 2)
    return (sum(seen.values()) - casts) / (b * t)


PRECISIONS = {
    "fp32": tessera_precision("fp32", False),
    "autocast": tessera_precision("bf16", False),
    "bf16": tessera_precision("bf16", True),
}


@pytest.mark.parametrize("mode", list(PRECISIONS))
@pytest.mark.parametrize(
    "model",
    [
        {"dim": 96, "n_heads": 6, "n_kv_heads": 2, "ffn_hidden": 160},  # Llama-style: RMSNorm, SwiGLU, GQA, RoPE
        {"dim": 64, "n_heads": 4, "n_kv_heads": 4, "activation": "gelu", "norm": "layernorm"},  # GPT-style
        {"dim": 96, "n_heads": 6, "n_kv_heads": 2, "moe": {"experts": 4, "top_k": 2, "ffn_hidden": 80}},  # MoE
    ],
    ids=["llama", "gpt", "moe"],
)
def test_block_accounting_equals_what_autograd_saves(mode, model):
    """tessera_block's bytes per token are the bytes autograd keeps for the real block (within 1%)."""
    model = dict(model)  # the parametrized dict is shared by every precision
    moe = model.pop("moe", None)
    cfg = _tiny(**model)
    if moe:
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **moe))
    shape = model_shape(cfg)
    predicted = tessera_block(shape, shape.blocks[0], PRECISIONS[mode]).full.bytes(1, 20)
    assert predicted == pytest.approx(_saved_bytes(cfg, mode), rel=0.01)


def test_bubble_fraction_is_p_minus_1_over_m_plus_p_minus_1():
    """Without data parallelism the bubble is (p-1)/(vm + p - 1) of the pipelined time."""
    shape = model_shape(_tiny(n_layers=8))
    for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2)):
        layout = Layout(pp=4, schedule=schedule, virtual=v, micro_batch=1, microbatches=8)
        s = estimate_speed(shape, layout, 64, 8, gpu("h100-80gb"))
        assert s.bubble / (s.compute + s.comm + s.bubble) == pytest.approx(3 / (v * 8 + 3))
    zero_bubble = estimate_speed(
        shape, Layout(pp=4, schedule="interleaved_zb", virtual=2, microbatches=8), 64, 8, gpu("h100")
    )
    interleaved = estimate_speed(
        shape, Layout(pp=4, schedule="interleaved_1f1b", virtual=2, microbatches=8), 64, 8, gpu("h100")
    )
    assert zero_bubble.bubble == pytest.approx(interleaved.bubble / 3)


def test_step_time_by_hand_for_tensor_parallel_in_one_node():
    """Compute = FLOPs / (peak x efficiency); TP: 4 exposed region collectives per block (8 for 2 blocks), 2 for the
    head and 2 for the embedding."""
    cfg = _tiny(n_layers=2, vocab_size=1024, dim=256, n_heads=8, n_kv_heads=8, ffn_hidden=512)
    shape = model_shape(cfg)
    g = gpu("h100-80gb")
    layout = Layout(tp=2, sp=False, micro_batch=4, microbatches=1)
    s = estimate_speed(shape, layout, 128, 4, g)
    tokens = 4 * 128
    # per block and token: q/k/v/o 4*256*256 + SwiGLU 3*256*512 = 655,360 weights split over tp=2, two norms of 256,
    # attention 12*256*128/2; the head (1024*256 + final norm 256) split over tp: 5,118,720 FLOPs per token per GPU
    per_token = 2 * (6 * 655_360 / 2 + 6 * 512 + 12 * 256 * 128 / 2) + 6 * 262_400 / 2
    assert per_token == 5_118_720
    flops = tokens * per_token
    assert s.compute == pytest.approx(flops / (g.peak_flops * g.efficiency), rel=1e-6)
    fp32 = estimate_speed(shape, layout, 128, 4, g, prec=tessera_precision("fp32", False))  # CUDA cores, TF32 off
    assert fp32.compute == pytest.approx(flops / (g.fp32_flops * g.efficiency), rel=1e-6)
    region = 2 * 1 / 2 * tokens * 256 * 2 / (g.nvlink * LINK_EFFICIENCY) + LATENCY_NVLINK
    assert s.comm == pytest.approx((8 + 2 + 2) * region, rel=1e-6)
    assert math.isclose(s.mfu, shape.flops_per_token(128) * tokens / s.step / 2 / g.peak_flops)


def test_memory_totals_are_in_bytes():
    assert GIB == 2**30
    assert isinstance(PRECISIONS["fp32"], Precision)


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "model",
    [
        {
            "layer_pattern": "M",
            "position": {"kind": "none"},
            "mamba": {"version": 1, "state": 8, "chunk": 16, "ffn": False},
        },
        {
            "layer_pattern": "M",
            "position": {"kind": "none"},
            "mamba": {"version": 2, "state": 8, "chunk": 16, "head_dim": 16},
        },
        {"mla": {"kv_rank": 32, "rope_head_dim": 8, "nope_head_dim": 16, "v_head_dim": 16}},
    ],
    ids=["mamba1", "mamba2-with-ffn", "latent-attention"],
)
def test_traced_mixers_equal_what_autograd_saves(mode, model):
    """Mamba and latent-attention blocks (measured once on fake tensors, FFN by formula) within 2% of autograd."""
    cfg = _tiny()
    for section, values in model.items():
        field = dataclasses.replace(getattr(cfg, section), **values) if isinstance(values, dict) else values
        cfg = dataclasses.replace(cfg, **{section: field})
    shape = model_shape(cfg)
    tokens = 2 * cfg.mamba.chunk if cfg.layer_pattern else cfg.max_seq_len
    predicted = tessera_block(shape, shape.blocks[0], PRECISIONS[mode]).full.bytes(1, tokens)
    assert predicted == pytest.approx(_saved_bytes(cfg, mode, (1, tokens)), rel=0.02)


def test_optimizer_state_is_adamw_moments_or_muon_momentum_in_the_state_dtype():
    """AdamW: 2 moments per parameter; Muon: 1 momentum per hidden-matrix parameter (the built optimizer's
    choice of matrices), AdamW's 2 for the rest; 4 bytes each in fp32 state, 2 in bf16."""
    from tessera.plan.memory import OptimizerState, Setting, optimizer_state_bytes, rank_share
    from tessera.train.optim import muon_parameters

    cfg = load_config(None, ["model.vocab_size=512", "model.dim=64", "model.n_layers=3", "model.n_heads=4"])
    model = build_model(cfg.model)
    total = sum(p.numel() for p in model.parameters())
    matrices = sum(p.numel() for p in muon_parameters(model))
    shape, layout = model_shape(cfg.model), Layout()
    share = rank_share(shape, layout, 0)
    prec = tessera_precision("fp32", False)
    expected = {
        ("adamw", 4): 8 * total,
        ("adamw", 2): 4 * total,
        ("muon", 4): 4 * matrices + 8 * (total - matrices),
        ("muon", 2): 2 * matrices + 4 * (total - matrices),
    }
    for (name, size), want in expected.items():
        setting = Setting(prec, 64, optimizer=OptimizerState(name, size))
        assert optimizer_state_bytes(shape, share, layout, setting) == want
