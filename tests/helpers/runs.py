"""Helpers the tests share: the tiny job, the CLI and torchrun runners, and run comparisons."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

from tessera.validate import load_config

REPO = Path(__file__).resolve().parents[2]

TINY_OVERRIDES = [
    "model.vocab_size=512",
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.max_seq_len=64",
    "train.seq_len=32",
    "train.batch_size=4",
    "train.steps=8",
    "train.eval_every=4",
    "train.eval_batches=2",
    "train.sample_tokens=0",
    "optim.warmup_steps=2",
    "optim.lr=1e-3",
    "data.max_chars=400000",
    "data.tokenizer_chars=400000",
    "checkpoint.every=4",
    "log.every=1",
    "log.progress=none",
    "log.tensorboard=false",
    "log.plot=false",
    "log.peak_flops=1e12",
]


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``python -m tessera ARGS`` in a subprocess and capture its output."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "tessera", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=REPO,
        timeout=timeout,
    )


def torchrun(nproc: int, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run ``torchrun --standalone --nproc-per-node N ARGS`` (a script path or ``-m module``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
    assert result.returncode == 0, f"torchrun failed ({result.returncode}):\n{result.stderr[-20000:]}"
    return result


def step_losses(run_dir: Path) -> list[float]:
    """Per-step training losses of a run's metrics.jsonl."""
    import json

    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


def step_records(run_dir: Path, after: int = 0) -> list[dict]:
    """The training-step records of a run's metrics.jsonl past step ``after`` (those a resumed run wrote)."""
    import json

    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r and r["step"] > after]


def assert_runs_match(
    run_dir: Path, reference_dir: Path, rtol: float = 1e-5, after: int = 0, checksum: bool = True
) -> int:
    """Parity of two runs: per-step loss AND grad norm within ``rtol`` for the steps after ``after``
    (AdamW hides a wrong gradient scale from the loss, not from the grad norm) and, at the end, the
    per-tensor norm of the parameters (the square root of the summaries' sums of squares: a relative error
    in the weights' units, where the sum of squares doubles it; zero-initialised norm weights and biases,
    made only of AdamW's sign-like updates, reach 1.2e-5 on the sum of squares under tp2 on an AMX CPU). The floor of 1e-6 on a norm is the
    old 1e-12 on a sum of squares: a parameter without a gradient (a BERT key bias) is rounding noise.
    Returns how many steps were compared."""
    import json

    got, want = step_records(run_dir, after), step_records(reference_dir, after)
    assert [r["step"] for r in got] == [r["step"] for r in want] and got, (got, want)
    assert_losses_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in want], rtol, what="grad norm")
    assert_losses_close([r["loss"] for r in got], [r["loss"] for r in want], rtol, what="loss")
    if checksum:
        mine = json.loads((Path(run_dir) / "summary.json").read_text())["param_sumsq"]
        ref = json.loads((Path(reference_dir) / "summary.json").read_text())["param_sumsq"]
        assert mine.keys() == ref.keys(), sorted(set(mine) ^ set(ref))
        for name, value in ref.items():
            norm, ref_norm = math.sqrt(mine[name]), math.sqrt(value)
            assert abs(norm - ref_norm) <= rtol * ref_norm + 1e-6, f"param {name}: norm {norm} vs {ref_norm}"
    return len(got)


def assert_losses_close(got: list[float], want: list[float], rtol: float = 1e-5, what: str = "loss") -> None:
    """Same number of steps, every step within ``rtol`` relative (the parity criterion)."""
    assert len(got) == len(want) and len(want) > 0, (got, want)
    for step, (a, b) in enumerate(zip(got, want), 1):
        assert abs(a - b) <= rtol * abs(b), (
            f"{what} at step {step}: {a} vs {b} (rel {abs(a - b) / abs(b):.2e} > {rtol})"
        )


def write_tiny_recipe(path: Path, cache_dir: Path, *overrides: str) -> Path:
    """A TOML recipe of the tiny job (plus ``overrides``) that torchrun workers can load."""
    path.write_text(load_config(None, [*TINY_OVERRIDES, f"data.cache_dir={cache_dir}", *overrides]).to_toml())
    return path


# The golden-curve runs (tests/integration/test_recipes.py; benchmarks/golden_drift.py measures drift on the same).
GOLDEN_OVERRIDES = [
    "train.steps=30",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.sample_tokens=0",
    "checkpoint.enabled=false",
    "log.progress=none",
    "log.tensorboard=false",
    "log.plot=false",
    "log.peak_flops=1e12",
    "log.every=1",
    "train.dtype=fp32",
    "train.threads=1",  # the curves' last digits depend on the thread count (2 threads: up to 9e-5 by step 18)
]
