"""Sparse upcycling on the smoke-sized model: validation loss of the upcycled MoE vs the dense model continued for
the same tokens vs the same MoE trained from scratch on those tokens.

    python benchmarks/upcycling.py [--steps 40] [--batch 8] [--out /tmp/upcycling]

1. dense: configs/smoke.toml for STEPS steps, exported as an HF directory (checkpoint.hf_every);
2. dense continued: init_from that directory, STEPS more steps;
3. upcycled: init_from that directory into an MoE recipe (4 experts, top-2, each as wide as the dense FFN);
4. MoE from scratch: the same MoE recipe, STEPS steps from random weights.
Runs 2-4 see the same tokens (same seed, data and schedule). Prints the final validation losses.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tessera.model.ffn import ffn_hidden_size
from tessera.validate import load_config


def _train(run: Path, *overrides: str) -> float:
    cmd = [
        sys.executable,
        "-m",
        "tessera",
        "train",
        "configs/smoke.toml",
        f"train.run_dir={run}",
        "train.overwrite=true",
        "log.progress=none",
        "log.plot=false",
        "log.tensorboard=false",
        "train.sample_tokens=0",
        *overrides,
    ]
    subprocess.run(cmd, check=True)
    vals = json.loads((run / "summary.json").read_text())["val_losses"]
    return vals[max(vals, key=int)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default="/tmp/upcycling")
    args = parser.parse_args()
    out, s = Path(args.out), args.steps
    common = [
        f"train.steps={s}",
        f"train.batch_size={args.batch}",
        f"optim.warmup_steps={max(1, s // 10)}",
        f"train.eval_every={s}",
        "checkpoint.every=1000000",
    ]
    m = load_config("configs/smoke.toml", []).model
    width = ffn_hidden_size(m.dim, m.activation, m.ffn_hidden, m.ffn_multiplier, m.multiple_of)
    moe = ["model.moe.experts=4", "model.moe.top_k=2", f"model.moe.ffn_hidden={width}"]
    dense = _train(out / "dense", *common, f"checkpoint.hf_every={s}")
    hf = out / "dense" / "hf" / f"step_{s:08d}"
    start = [f"train.init_from={hf}", f"data.tokenizer={hf}"]
    results = {
        f"dense, {s} steps (the source)": dense,
        f"dense continued {s} steps": _train(out / "continued", *common, *start),
        f"upcycled MoE {s} steps": _train(out / "upcycled", *common, *start, *moe),
        f"MoE from scratch {s} steps": _train(out / "scratch", *common, *moe, f"data.tokenizer={hf}"),
    }
    for name, value in results.items():
        print(f"{name:>34}: val loss {value:.4f}")


if __name__ == "__main__":
    main()
