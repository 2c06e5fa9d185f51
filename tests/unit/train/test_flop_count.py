"""tessera's FLOP count (tessera/train/flop_count.py) against torch's FlopCounterMode on one forward + backward.

Every recipe in configs/tiny/ (seq 64, batch 2), plus the components no tiny recipe has: multi-token
prediction, Performer and linear attention, Longformer's block-sparse pattern, full and every-n-th
activation checkpointing (the recompute runs inside backward and is counted there) and op-level
checkpointing of a Mamba hybrid (its convolution is recomputed). FlopCounterMode counts matmuls,
convolutions and attention kernels; attention runs on the math path here so its products are visible
(FlopCounterMode has no formula for the CPU flash kernel). What it cannot see (softmax, norms,
activations, the loss, the elementwise part of a Mamba scan) tessera does not count either.

Tolerance 1e-9 relative: the count is exact (the issue asked for 3%), including the backward of products
with one operand that needs no gradient (Performer's fixed projection, Mamba-2's zero initial state and
unused final state) and torch's checkpoint stopping its recompute before a pre-norm block's last product.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

from tessera.data.batch import Batch
from tessera.data.objectives import IGNORE, Objective
from tessera.model import build_model
from tessera.model.blocks import block_containers
from tessera.model.moe import MoELog
from tessera.model.mtp import MTPLog
from tessera.parallel.activation import apply_activation_checkpointing
from tessera.train.flop_count import count_config, count_model, sample_lengths
from tessera.validate import load_config

RECIPES = sorted(Path("configs/tiny").glob("*.toml"))
SEQ, BATCH, RTOL = 64, 2, 1e-9
VARIANTS = {
    "llama+mtp2": ("llama", ["model.mtp_depth=2"], "none"),
    "llama+performer": ("llama", ["model.attention.kernel=performer"], "none"),
    "llama+linear": ("llama", ["model.attention.kernel=linear"], "none"),
    "llama+longformer": (
        "llama",
        ["model.attention.kernel=longformer", "model.attention.sliding_window=16", "model.attention.global_tokens=4"],
        "none",
    ),
    "mixtral+full_ac": ("mixtral", [], "full"),
    "deepseek_v3+selective_ac": ("deepseek_v3", [], "selective"),
    "jamba+op_ac": ("jamba", [], "op"),
    "deepseek_v3+8_layers": ("deepseek_v3", ["model.n_layers=8", "model.moe.every=2", "model.mtp_depth=1"], "none"),
    "jamba+16_layers": ("jamba", ["model.n_layers=16", "model.moe.every=2"], "selective"),
}
CASES = {path.stem: (path.stem, [], "none") for path in RECIPES} | VARIANTS


def _grouped_conv_backward(
    grad_out_shape,
    x_shape,
    w_shape,
    _bias,
    _stride,
    _padding,
    _dilation,
    _transposed,
    _output_padding,
    _groups,
    output_mask,
    out_shape=None,
    **kwargs,
) -> int:
    """convolution_backward with groups: each requested gradient costs the forward's products.
    (torch's formula ignores groups for the weight gradient: a depthwise conv's counts as a dense C x C one.)"""
    return sum(bool(m) for m in output_mask[:2]) * conv_flop_count(x_shape, w_shape, grad_out_shape)


FIXES = {torch.ops.aten.convolution_backward: _grouped_conv_backward}


def _measured(model: torch.nn.Module, cfg, tokens: torch.Tensor) -> float:
    """FlopCounterMode's total for one forward + backward of the recipe's objective and its MTP heads."""
    args, kwargs, labels, _ = Objective(cfg, seed=0)(Batch(tokens))
    mtp = MTPLog() if cfg.mtp_depth else None
    extra = {"mtp": mtp} if mtp is not None else {}
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False, custom_mapping=FIXES) as counter:
        logits = model(*args, **kwargs, moe_log=MoELog(), **extra)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
        for depth_logits in mtp.logits if mtp is not None else []:
            loss = loss + depth_logits.float().pow(2).mean()
        loss.backward()
    return float(counter.get_total_flops()), args


# Recipes whose components the count does not know yet (strict: the mark fails once the count is right).
NOT_COUNTED = {
    "gpt_oss": "gpt-oss (landed after the count): its sinks run sdpa on a padded virtual key, its experts as a "
    "biased loop; neither is a term yet (counted 5.387e7 vs 1.155e8)",
    "deepseek_v32": "DeepSeek-V3.2's sparse attention indexer (landed on main after the count; its scoring "
    "products and top-k key selection are not terms yet: counted 2.066e8 vs 1.989e8)",
}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=NOT_COUNTED[c])) if c in NOT_COUNTED else c
        for c in sorted(CASES)
    ],
)
def test_count_matches_flop_counter(case):
    recipe, overrides, checkpoint = CASES[case]
    job = load_config(f"configs/tiny/{recipe}.toml", [f"train.seq_len={SEQ}", *overrides])
    cfg = job.model
    torch.manual_seed(0)
    model = build_model(cfg)
    apply_activation_checkpointing(block_containers(model), checkpoint, job.parallel.ac_every)
    tokens = torch.randint(0, cfg.vocab_size - cfg.sentinel_tokens, (BATCH, SEQ + 1))
    measured, args = _measured(model, cfg, tokens)
    lengths = sample_lengths(cfg, SEQ)
    assert (lengths.tokens, lengths.memory) == (
        (args[-1].shape[1], args[0].shape[1]) if len(args) == 2 else (args[0].shape[1], 0)
    )
    counted = count_model(model, cfg, lengths, checkpoint, job.parallel.ac_every).hardware_training * BATCH
    assert counted == pytest.approx(measured, rel=RTOL), (
        f"{case}: counted {counted:.4g}, FlopCounterMode {measured:.4g}"
    )
    # what the trainer and planner use: a meta build of one period of the layers, repeated
    reduced = count_config(cfg, SEQ, checkpoint, job.parallel.ac_every).hardware_training * BATCH
    assert reduced == pytest.approx(measured, rel=RTOL), f"{case}: one period counts {reduced:.4g}"
