"""QAT + convert against post-training quantization of the same run, by validation perplexity.

One recipe (default: the smoke recipe, shortened) is trained three times from the same seed and data:
without QAT, with ``train.qat=int8-weight`` and with ``train.qat=int4-weight``, both switched on at
``--qat-start``. Each QAT run is converted with its own scheme (``tessera convert quantize``); the
plain run is converted with both (post-training quantization). Perplexity on the validation split.

    python benchmarks/qat.py --steps 120 --qat-start 80 [--recipe configs/smoke.toml] [overrides...]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from tessera.analysis.runs import load_run, validation_batches, validation_loss
from tessera.api import load
from tessera.quantize.convert import quantize_run
from tessera.train.trainer import train
from tessera.validate import load_config

SCHEMES = ("int8-weight", "int4-weight")


def _perplexity(path: Path, batches: list) -> float:
    return float(torch.tensor(validation_loss(load(path), batches)).exp())


def main() -> None:
    """Train, convert, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="configs/smoke.toml")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--qat-start", type=int, default=80)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=32, help="int4-weight: QAT's and PTQ's group size")
    parser.add_argument("--out", default="")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    tmp = Path(args.out or tempfile.mkdtemp(prefix="tessera-qat-"))
    base = [f"train.steps={args.steps}", "train.eval_every=0", "train.sample_tokens=0", *args.overrides]
    runs = {"none": tmp / "ptq"} | {scheme: tmp / f"qat-{scheme}" for scheme in SCHEMES}
    for qat, run in runs.items():
        extra = [] if qat == "none" else [f"train.qat={qat}", f"train.qat_start={args.qat_start}"]
        extra += [f"train.qat_group_size={args.group_size}"] if qat == "int4-weight" else []
        train(load_config(args.recipe, [*base, *extra, f"train.run_dir={run}"]))
    batches, _ = validation_batches(load_run(runs["none"]).config, args.batches)
    print(
        f"{args.recipe}, {args.steps} steps, QAT from step {args.qat_start}, int4 group {args.group_size}; perplexity on {args.batches} batches"
    )
    print(f"{'scheme':<12} {'fp32 (no QAT)':>14} {'PTQ':>9} {'QAT fp32':>9} {'QAT+convert':>12} {'QAT vs PTQ':>10}")
    fp32 = float(torch.tensor(validation_loss(load(runs["none"]), batches)).exp())
    for scheme in SCHEMES:
        ptq = _perplexity(quantize_run(runs["none"], tmp / f"ptq-{scheme}", scheme, args.group_size), batches)
        qat_fp32 = float(torch.tensor(validation_loss(load(runs[scheme]), batches)).exp())
        qat = _perplexity(quantize_run(runs[scheme], tmp / f"qat-{scheme}-q", scheme, args.group_size), batches)
        print(f"{scheme:<12} {fp32:14.3f} {ptq:9.3f} {qat_fp32:9.3f} {qat:12.3f} {100 * (qat / ptq - 1):+9.2f}%")


if __name__ == "__main__":
    main()
