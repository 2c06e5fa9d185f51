"""Data pipeline throughput: prepare (tokens/s, 1 and 2 workers) and loader vs training (sequences/s).

    python benchmarks/data.py [--max-chars 8000000] [--batches 200] [--steps 5]

The loader is compared with what the smoke model (configs/smoke.toml) consumes per second on
this machine; the target is a loader at least 50x faster than training. Not a test: figures
are printed, nothing is asserted.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from tessera.config import load_config
from tessera.data.pipeline import build_data, build_tokenizer
from tessera.data.prepare import write_indexed_dataset
from tessera.data.sources import load_corpus
from tessera.train.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent


def prepare_throughput(max_chars: int, workers: int, out: Path) -> tuple[float, int]:
    """Tokens/s of tokenizing the default corpus (first ``max_chars``) into an indexed dataset."""
    config = load_config(REPO / "configs" / "smoke.toml")
    docs, corpus_hash = load_corpus("default", max_chars)
    tokenizer, _ = build_tokenizer(config, docs, corpus_hash)
    summary = write_indexed_dataset((d.text for d in docs), tokenizer, out / f"w{workers}", workers)
    return summary.tokens_per_s, summary.tokens


def loader_throughput(run_dir: Path, batches: int) -> float:
    """Sequences/s the smoke recipe's training loader delivers (prefetch thread on, no model)."""
    config = load_config(REPO / "configs" / "smoke.toml", [f"train.run_dir={run_dir}"])
    loader = build_data(config).train
    loader.next_batch()  # warm: index caches, first prefetch
    started = time.perf_counter()
    for _ in range(batches):
        loader.next_batch()
    seconds = time.perf_counter() - started
    loader.close()
    return batches * config.train.batch_size / seconds


def training_throughput(run_dir: Path, steps: int) -> float:
    """Sequences/s the smoke model consumes in full optimizer steps (forward, backward, update)."""
    config = load_config(REPO / "configs" / "smoke.toml", [f"train.run_dir={run_dir}", "train.resume=none"])
    trainer = Trainer(config)
    trainer.train_step()  # warm-up
    started = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    seconds = time.perf_counter() - started
    trainer.data.train.close()
    return steps * config.train.batch_size * config.train.grad_accum / seconds


def main() -> None:
    """Run the three measurements and print the figures and the loader/training ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-chars", type=int, default=8_000_000, help="characters of the default corpus to prepare")
    parser.add_argument("--batches", type=int, default=200, help="loader batches to time")
    parser.add_argument("--steps", type=int, default=5, help="training steps to time")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        prepare_throughput(args.max_chars // 10, 1, tmp_path)  # warm-up: imports, page cache, tokenizer
        for workers in (1, 2):
            rate, tokens = prepare_throughput(args.max_chars, workers, tmp_path)
            print(f"prepare  default corpus, {workers} worker(s): {rate:>12,.0f} tokens/s ({tokens:,} tokens)")
        loader = loader_throughput(tmp_path / "run", args.batches)
        train = training_throughput(tmp_path / "run", args.steps)
    print(f"loader   smoke recipe (batch 16 x 128):    {loader:>12,.0f} sequences/s")
    print(f"training smoke model:                      {train:>12,.1f} sequences/s")
    print(f"ratio    loader / training:                {loader / train:>12,.0f}x (target >= 50x)")


if __name__ == "__main__":
    main()
