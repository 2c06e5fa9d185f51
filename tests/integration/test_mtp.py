"""Multi-token prediction: the module's arithmetic, its targets, training with per-depth losses, parity of
the MTP losses under FSDP, DDP, TP (with and without SP) and PP (CP: test_mtp_context_parallel.py)."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.config import model_config
from tessera.model import build_model
from tessera.model.mtp import MTPLog, mtp_targets
from tessera.train.trainer import train

from helpers.runs import assert_runs_match, step_records, torchrun, write_tiny_recipe

KW = dict(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, mtp_depth=2)


def test_each_depth_reads_the_previous_state_and_the_next_tokens_embedding():
    torch.manual_seed(0)
    model = build_model(model_config(**KW)).eval()
    tokens = torch.randint(0, 50, (2, 10))
    log = MTPLog()
    with torch.no_grad():
        logits = model(tokens, mtp=log)
        hidden = model.hidden_states(model.tok_embeddings(tokens))
        ctx = model.context(2, 10, 0, None, None, tokens.device)
        for depth, module in enumerate(model.mtp.values(), 1):
            x = torch.cat([module.enorm(model.tok_embeddings(tokens.roll(-depth, 1))), module.hnorm(hidden)], -1)
            hidden = module.block(module.eh_proj(x), ctx)
            torch.testing.assert_close(log.logits[depth - 1], model.output(module.norm(hidden)), rtol=0, atol=1e-6)
    torch.testing.assert_close(logits, model(tokens), rtol=0, atol=0)  # the main logits do not change
    # Position i of depth k sees tokens up to i + k only: changing token 7 changes depth 2 from position 5 on.
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 50
    other = MTPLog()
    with torch.no_grad():
        model(changed, mtp=other)
    same = (other.logits[1] - log.logits[1]).abs().amax(dim=(0, 2)) == 0
    assert same[:5].all() and not same[5:8].any()


def test_targets_are_the_labels_further_ahead_without_the_wrapped_tail():
    labels = torch.arange(12).view(2, 6)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4] = False
    got, got_mask = mtp_targets(labels, mask, 2)
    assert torch.equal(got[:, :4], labels[:, 2:])
    assert got_mask.tolist() == [[True] * 4 + [False] * 2, [True, True, False, True, False, False]]


STEPS = 4
BASE = [
    f"train.steps={STEPS}",
    "train.batch_size=4",
    "log.every=1",
    "optim.schedule=constant",
    "train.eval_every=0",
    "checkpoint.enabled=false",
    "model.mtp_depth=2",
    "train.mtp_loss_weight=0.5",
]


def test_training_logs_each_depths_loss(tiny_config):
    from tessera.train.trainer import Trainer

    run = Trainer(tiny_config(*BASE, "train.steps=6", "train.eval_every=3")).fit()
    records = step_records(run.run_dir)
    assert all({"mtp_loss_1", "mtp_loss_2"} <= r.keys() for r in records)
    assert records[-1]["mtp_loss_1"] < records[0]["mtp_loss_1"]
    # the logged loss is the objective: main loss + 0.5 * mean(depth losses); eval stays the main loss
    assert all(r["loss"] > 0.25 * (r["mtp_loss_1"] + r["mtp_loss_2"]) for r in records)


@pytest.mark.slow
def test_mtp_under_fsdp_ddp_tp_and_pp_matches_one_process(tmp_path, cache_dir):
    recipe = write_tiny_recipe(tmp_path / "base.toml", cache_dir, *BASE)
    from tessera.validate import load_config

    reference = train(load_config(recipe, [f"train.run_dir={tmp_path}/ref"])).run_dir
    variants = {
        "fsdp2": ["parallel.dp_shard=2"],
        "ddp2": ["parallel.dp_shard=1", "parallel.dp_replicate=2"],
        "tp2_sp": ["parallel.dp_shard=1", "parallel.tp=2"],
        "tp2": ["parallel.dp_shard=1", "parallel.tp=2", "parallel.sequence_parallel=false"],
        "pp2": ["parallel.dp_shard=1", "parallel.pp=2"],
    }
    torchrun(2, "tests/helpers/dist_variants.py", str(recipe), str(tmp_path), json.dumps(variants))
    want = step_records(reference)
    for name in variants:
        assert assert_runs_match(tmp_path / name, reference) == STEPS, name
        got = step_records(tmp_path / name)
        for key in ("mtp_loss_1", "mtp_loss_2"):
            assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-5), (name, key)


def test_deepseek_v3_checkpoints_carry_the_mtp_modules(tmp_path):
    from safetensors.torch import load_file

    from tessera.hf.weights import load_hf, save_hf

    cfg = model_config(
        vocab_size=64,
        dim=32,
        n_layers=2,
        n_heads=4,
        max_seq_len=64,
        mtp_depth=1,
        activation="swiglu",
        norm="rmsnorm",
        mla={"kv_rank": 16, "rope_head_dim": 8, "nope_head_dim": 8, "v_head_dim": 12},
    )
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    for p in model.parameters():  # norms away from 1 so a swapped norm shows
        torch.nn.init.normal_(p, std=0.2)
    assert save_hf(model, tmp_path / "hf") == "deepseek_v3"
    names = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert {"model.layers.2.eh_proj.weight", "model.layers.2.shared_head.norm.weight"} <= names.keys()
    back = load_hf(tmp_path / "hf").eval()
    assert back.cfg.mtp_depth == 1
    tokens = torch.randint(0, 64, (2, 12))
    ours, theirs = MTPLog(), MTPLog()
    with torch.no_grad():
        model(tokens, mtp=ours), back(tokens, mtp=theirs)
    torch.testing.assert_close(theirs.logits[0], ours.logits[0], rtol=0, atol=0)
    import transformers  # transformers reads the export (it skips the MTP layer) and agrees on the main logits

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-4, atol=1e-4)
