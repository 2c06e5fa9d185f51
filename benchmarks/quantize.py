"""Quantized models out: perplexity, bytes and CPU decoding speed of each torchao scheme, same run.

    python benchmarks/quantize.py --run runs/smoke                    # a trained run: perplexity too
    python benchmarks/quantize.py --random "model.dim=768 model.n_layers=12 model.n_heads=12 model.vocab_size=32000"

For each of fp32, int8-weight, int4-weight and fp8 it writes ``tessera convert quantize`` output
(the fp32 one is the plain HF export), then reports the bytes of its safetensors, the validation
perplexity of the run's first ``--batches`` validation batches (``--run`` only; a random model's
perplexity says nothing) and greedy decoding tokens/s (batch 1, ``--new-tokens`` tokens, KV cache)
of the model tessera loads from the directory. Rounds alternate between the four so machine noise
hits all alike; median and spread (max/min) over ``--rounds``. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tessera.api import load
from tessera.hf.convert import hf_export
from tessera.quantize.convert import quantize_run

SCHEMES = ("fp32", "int8-weight", "int4-weight", "fp8")


def _random_run(overrides: str, where: Path, tokenizer_run: Path) -> Path:
    """A run directory holding one step-0 checkpoint of a randomly initialized model (and the tokenizer
    of ``tokenizer_run``, which the HF export copies)."""
    import shutil

    from tessera.model import build_model
    from tessera.train.checkpoint import Checkpointer
    from tessera.validate import load_config

    config = load_config("configs/smoke.toml", [*overrides.split(), f"train.run_dir={where}"])
    torch.manual_seed(0)
    model = build_model(config.model)
    where.mkdir(parents=True)
    (where / "config.toml").write_text(config.to_toml())
    shutil.copyfile(tokenizer_run / "tokenizer.model", where / "tokenizer.model")
    extra = {"config": config.to_dict(), "model": config.to_dict()["model"]}
    Checkpointer(where, keep_last=1).save(0, model, torch.optim.AdamW(model.parameters()), extra)
    return where


def _decode_seconds(model: torch.nn.Module, new_tokens: int) -> float:
    from tessera.model import generate

    ids = torch.tensor([[5, 17, 42, 9]])
    started = time.perf_counter()
    generate(model, ids, new_tokens, temperature=0.0)
    return time.perf_counter() - started


def _perplexity(model: torch.nn.Module, batches: list) -> float:
    from tessera.analysis.runs import validation_loss

    return float(torch.tensor(validation_loss(model, batches)).exp())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="", help="a trained run directory")
    parser.add_argument("--random", default="", help="model overrides of a randomly initialized model instead")
    parser.add_argument("--tokenizer-run", default="runs/smoke", help="--random: the run whose tokenizer is copied")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="tessera-quant-"))
    run = Path(args.run) if args.run else _random_run(args.random, tmp / "run", Path(args.tokenizer_run))
    dirs = {"fp32": tmp / "fp32"}
    hf_export(run, dirs["fp32"])
    for scheme in SCHEMES[1:]:
        dirs[scheme] = quantize_run(run, tmp / scheme, scheme)
    models = {scheme: load(path) for scheme, path in dirs.items()}
    n_params = sum(p.numel() for p in models["fp32"].parameters())
    print(f"model: {n_params / 1e6:.1f}M parameters ({'trained ' + str(run) if args.run else 'random init'})")
    ppl = {}
    if args.run:
        from tessera.analysis.runs import load_run, validation_batches

        batches, _ = validation_batches(load_run(run).config, args.batches)
        ppl = {scheme: _perplexity(model, batches) for scheme, model in models.items()}
    seconds: dict[str, list[float]] = {scheme: [] for scheme in SCHEMES}
    for scheme in SCHEMES:  # warm-up
        _decode_seconds(models[scheme], 4)
    for _ in range(args.rounds):
        for scheme in SCHEMES:
            seconds[scheme].append(_decode_seconds(models[scheme], args.new_tokens))
    base_bytes = sum(f.stat().st_size for f in dirs["fp32"].glob("*.safetensors"))
    base_tps = args.new_tokens / statistics.median(seconds["fp32"])
    print(f"{'scheme':<12} {'bytes':>12} {'x fp32':>7} {'ppl':>9} {'dppl':>8} {'tok/s':>8} {'x fp32':>7} {'spread':>7}")
    for scheme in SCHEMES:
        size = sum(f.stat().st_size for f in dirs[scheme].glob("*.safetensors"))
        tps = args.new_tokens / statistics.median(seconds[scheme])
        spread = max(seconds[scheme]) / min(seconds[scheme])
        p = f"{ppl[scheme]:9.3f} {100 * (ppl[scheme] / ppl['fp32'] - 1):+7.2f}%" if ppl else f"{'-':>9} {'-':>8}"
        print(f"{scheme:<12} {size:>12,} {size / base_bytes:7.3f} {p} {tps:8.1f} {tps / base_tps:7.3f} {spread:7.2f}")


if __name__ == "__main__":
    main()
