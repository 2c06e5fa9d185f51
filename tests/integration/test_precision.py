"""Every precision the README claims, trained and checked in numbers; label smoothing.

Measured on the tiny job (5-8 steps, dim 64): single-process bf16 autocast is ~1e-5 from fp32 in
loss and ~4e-4 in grad norm; fp16 autocast ~3e-6 / ~4e-5. Layouts in bf16 against the single
process in bf16: FSDP2 (parameters cast to bf16, so norms and softmax run in bf16 too) ~3e-5 /
~2e-3, TP ~6e-6 / ~3e-4; DDP in fp16 against one fp16 process ~7e-7 / ~1.5e-5; FSDP, TP and PP
in fp16 (ShardedGradScaler; a pipeline scales its own loss) ~5e-6 / ~2e-4. The tolerances
below are those with a margin; each low-precision run must also differ from fp32, which proves
the precision was in effect.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tessera.validate import load_config
from tessera.train.trainer import Trainer, train

from helpers.runs import step_records, torchrun, write_tiny_recipe

MOE = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden=96", "model.moe.aux_loss_coef=0.01"]
QUICK = ["train.eval_every=0", "checkpoint.enabled=false", "optim.schedule=constant", "train.batch_size=8"]


def _max_rel(run, ref, key: str) -> float:
    got, want = step_records(run), step_records(ref)
    assert [r["step"] for r in got] == [r["step"] for r in want] and got
    return max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(got, want))


def _assert_close_but_not_equal(run, ref, loss_tol: float, gnorm_tol: float) -> None:
    loss, gnorm = _max_rel(run, ref, "loss"), _max_rel(run, ref, "grad_norm")
    assert loss <= loss_tol and gnorm <= gnorm_tol, f"{run.name}: loss {loss:.2e}, grad norm {gnorm:.2e}"


def test_bf16_and_fp16_autocast_track_fp32_and_differ_from_it(tiny_config, tmp_path):
    runs = {
        dt: train(tiny_config(*QUICK, f"train.dtype={dt}", run_dir=tmp_path / dt)).run_dir
        for dt in ("fp32", "bf16", "fp16")
    }
    for dt, (loss_tol, gnorm_tol) in {"bf16": (1e-4, 5e-3), "fp16": (1e-4, 1e-3)}.items():
        _assert_close_but_not_equal(runs[dt], runs["fp32"], loss_tol, gnorm_tol)
        assert _max_rel(runs[dt], runs["fp32"], "grad_norm") > 1e-7, f"{dt} equals fp32: autocast was not in effect"


def test_fp16_grad_scaler_skips_an_overflowing_step_and_backs_off(tiny_config, tmp_path):
    trainer = Trainer(tiny_config(*QUICK, "train.dtype=fp16", "optim.grad_clip=1.0"))
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)  # fp16 gradients overflow at once
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.train_step()
    assert not torch.isfinite(torch.tensor(metrics["grad_norm"]))
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters()), (
        "an overflowing step updated weights"
    )
    assert trainer.scaler.get_scale() == 2.0**99  # backoff factor 0.5
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    assert torch.isfinite(torch.tensor(trainer.train_step()["grad_norm"]))
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_label_smoothing_is_cross_entropy_with_smoothing_on_the_same_logits(tiny_config, tmp_path):
    trainer = Trainer(tiny_config(*QUICK, "train.label_smoothing=0.5", "train.grad_accum=1"))
    state = trainer.data.train.state_dict()
    (inputs,), kwargs, labels, _ = trainer.objective(trainer.data.train.next_batch())
    trainer.data.train.load_state_dict(state)
    with torch.no_grad():
        logits = trainer.model(inputs, **kwargs).flatten(0, 1)
    smoothed = F.cross_entropy(logits, labels.flatten(), label_smoothing=0.5).item()
    plain = F.cross_entropy(logits, labels.flatten()).item()
    assert abs(smoothed - plain) > 20e-6 * smoothed  # near-uniform logits at init: small, but 20x the tolerance
    assert trainer.train_step()["loss"] == pytest.approx(smoothed, rel=1e-6)


@pytest.mark.slow
def test_bf16_under_fsdp_and_tp_and_fp16_under_ddp_match_one_process(tmp_path, cache_dir):
    recipe = write_tiny_recipe(tmp_path / "job.toml", cache_dir, *QUICK, "train.steps=5")
    refs = {
        dt: train(load_config(recipe, [f"train.dtype={dt}", f"train.run_dir={tmp_path}/single_{dt}"])).run_dir
        for dt in ("fp32", "bf16", "fp16")
    }
    for dt in ("fp32", "fp16"):
        refs[f"moe_{dt}"] = train(
            load_config(recipe, [*MOE, f"train.dtype={dt}", f"train.run_dir={tmp_path}/moe_{dt}"])
        ).run_dir
    variants = {
        "fsdp_bf16": ["parallel.dp_shard=2", "train.dtype=bf16"],
        "tp_bf16": ["parallel.dp_shard=1", "parallel.tp=2", "train.dtype=bf16"],
        "ddp_fp16": ["parallel.dp_replicate=2", "parallel.dp_shard=1", "train.dtype=fp16"],
        # fp16 with sharded or split gradients: the sharded grad scaler decides overflow on all ranks
        "fsdp_fp16": ["parallel.dp_shard=2", "train.dtype=fp16"],
        "tp_fp16": ["parallel.dp_shard=1", "parallel.tp=2", "train.dtype=fp16"],
        "pp_fp16": ["parallel.dp_shard=1", "parallel.pp=2", "parallel.microbatches=2", "train.dtype=fp16"],
        # expert gradients live on the ep mesh: the scaler's found-inf flag still covers them
        "ep_fp16": [*MOE, "parallel.dp_shard=2", "parallel.ep=2", "train.dtype=fp16"],
    }
    torchrun(2, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(variants))
    _assert_close_but_not_equal(tmp_path / "fsdp_bf16", refs["bf16"], 2e-4, 1e-2)
    _assert_close_but_not_equal(tmp_path / "tp_bf16", refs["bf16"], 1e-4, 3e-3)
    _assert_close_but_not_equal(tmp_path / "ddp_fp16", refs["fp16"], 1e-5, 2e-4)
    for name in ("fsdp_fp16", "tp_fp16", "pp_fp16"):
        _assert_close_but_not_equal(tmp_path / name, refs["fp16"], 2e-5, 1e-3)
    _assert_close_but_not_equal(tmp_path / "ep_fp16", refs["moe_fp16"], 2e-5, 1e-3)
    for name in variants:
        fp32 = refs["moe_fp32" if name == "ep_fp16" else "fp32"]
        assert _max_rel(tmp_path / name, fp32, "grad_norm") > 1e-6, f"{name} equals fp32"
