"""End to end through the console: train a tiny job, inspect its outputs, generate from it."""

from __future__ import annotations

import json
import math

from helpers.runs import TINY_OVERRIDES, run_cli


def test_train_writes_metrics_tensorboard_plot_checkpoint_and_sample(tmp_path, cache_dir):
    run = tmp_path / "run"
    overrides = [o for o in TINY_OVERRIDES if not o.startswith(("log.", "train.sample_tokens"))]
    result = run_cli(
        "train",
        "configs/smoke.toml",
        *overrides,
        f"train.run_dir={run}",
        f"data.cache_dir={cache_dir}",
        "train.steps=6",
        "train.eval_every=3",
        "log.every=2",
        "train.sample_tokens=12",
        "train.sample_prompt=import ",
        "log.progress=lines",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "step 6/6" in out and "sample:\nimport " in out and "done: step 6" in out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 2, 3, 4, 6]
    for r in records[1:]:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= set(r)
        assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
    assert {r["step"] for r in records if "val_loss" in r} == {0, 3, 6}
    assert (run / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(p.name.startswith("events.out.tfevents") for p in (run / "tensorboard").iterdir())
    assert (run / "checkpoints" / "step_00000006" / "meta.json").is_file()
    assert (run / "config.toml").is_file() and (run / "tokenizer.model").is_file()

    gen = run_cli("generate", str(run), "--prompt", "def ", "--max-new-tokens", "10", "--greedy")
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert gen.stdout.startswith("def ")
    assert "decoding cache (auto): 512 bytes per token" in gen.stderr  # 2 layers x (K, V) x 2 kv heads x 16 x fp32
    again = run_cli(
        "generate", str(run / "checkpoints" / "step_00000006"), "--prompt", "def ", "--max-new-tokens", "10", "--greedy"
    )
    assert again.stdout == gen.stdout
