"""AdamW vs Muon on a recipe (the smoke job by default): a short learning-rate sweep, then final validation loss.

Each configuration is one ``tessera train`` of the same recipe, steps, data and seed; only the
optimizer keys differ. With ``optim.muon.scale = "rms"`` Muon's matrices take the same learning
rate as AdamW's (Moonlight's rule), so one ``lr`` sweeps both. Prints per run the final and best
validation loss and the median tokens/s of the logging windows; runs go one after another, so
tokens/s is only comparable on an otherwise idle machine.

    python benchmarks/optimizer_compare.py [--recipe configs/smoke.toml] [--lrs 3e-3,6e-3] [--out runs/optim_compare]
        [--extra train.threads=1 ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from tessera.train.metrics import read_metrics

OPTIMIZERS = {
    "adamw": [],
    "muon": ["optim.name=muon"],
    "adamw_bf16": ["optim.state_dtype=bf16"],
    "muon_bf16": ["optim.name=muon", "optim.state_dtype=bf16"],
}


def run_one(recipe: str, run_dir: Path, overrides: list[str]) -> dict:
    """Train ``recipe`` into ``run_dir`` with ``overrides``; returns its losses and speed."""
    cmd = [sys.executable, "-m", "tessera", "train", recipe, f"train.run_dir={run_dir}", "train.resume=none"]
    cmd += ["checkpoint.enabled=false", "train.sample_tokens=0", *overrides]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((run_dir / "summary.json").read_text())
    vals = list(summary["val_losses"].values())
    speeds = [r["tokens_per_s"] for r in read_metrics(run_dir) if "tokens_per_s" in r]
    return {"final_val": vals[-1], "best_val": min(vals), "tokens_per_s": statistics.median(speeds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="configs/smoke.toml")
    parser.add_argument("--lrs", default="3e-3,6e-3", help="comma-separated peak learning rates")
    parser.add_argument("--optimizers", default="adamw,muon", help=f"comma-separated, of {', '.join(OPTIMIZERS)}")
    parser.add_argument("--out", default="runs/optim_compare")
    parser.add_argument("--extra", nargs="*", default=[], help="more key=value overrides for every run")
    args = parser.parse_args()
    print(f"{'optimizer':<11} {'lr':>8} {'final val':>10} {'best val':>9} {'tok/s':>8}", flush=True)
    for lr in args.lrs.split(","):
        for name in args.optimizers.split(","):
            run_dir = Path(args.out) / f"{name}_lr{lr}"
            r = run_one(args.recipe, run_dir, [*OPTIMIZERS[name], f"optim.lr={lr}", *args.extra])
            print(
                f"{name:<11} {lr:>8} {r['final_val']:>10.4f} {r['best_val']:>9.4f} {r['tokens_per_s']:>8.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
