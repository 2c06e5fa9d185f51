"""Data pipeline throughput: prepare (tokens/s, 1 and 2 workers) and loader vs training (sequences/s).

    python benchmarks/data.py [--max-chars 8000000] [--batches 200] [--steps 5]

``prepare`` is measured side by side for tessera's default SentencePiece BPE and an HF
byte-level BPE (``tokenizer.json``, the fast tokenizer's batch API), both trained on the same
corpus with the smoke recipe's vocabulary, in rounds that alternate the two; each figure is the
median [min-max] over rounds. Tokens/s depend on how many tokens a tokenizer makes of the text,
so characters/s are printed too. Each worker process encodes on one thread
(TOKENIZERS_PARALLELISM=false), so "N workers" means N cores for both.

The loader is compared with what the smoke model (configs/smoke.toml) consumes per second on
this machine; the target is a loader at least 50x faster than training. Not a test: figures
are printed, nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tessera.validate import load_config
from tessera.data.pipeline import build_data, build_tokenizer
from tessera.data.prepare import write_indexed_dataset
from tessera.data.sources import load_corpus
from tessera.train.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent


def prepare_throughput(max_chars: int, workers: int, out: Path, kind: str = "default") -> tuple[float, float, int]:
    """Tokens/s and characters/s of tokenizing the default corpus (first ``max_chars``) into an indexed dataset
    with the ``kind`` tokenizer ("default" SentencePiece or "bpe"), trained on the same text (cached)."""
    config = load_config(REPO / "configs" / "smoke.toml")
    docs, corpus_hash = load_corpus("default", max_chars)
    tokenizer, _ = build_tokenizer(config, docs, corpus_hash, kind)
    summary = write_indexed_dataset((d.text for d in docs), tokenizer, out / f"{kind}{workers}", workers)
    chars = sum(len(d.text) for d in docs)
    return summary.tokens_per_s, chars / max(summary.seconds, 1e-9), summary.tokens


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


def print_prepare_rounds(max_chars: int, rounds: int, out: Path) -> None:
    """Prepare throughput of both tokenizers with 1 and 2 workers, rounds alternating the tokenizers."""
    names = {"default": "SentencePiece BPE (.model)", "bpe": "HF byte-level BPE (tokenizer.json)"}
    for workers in (1, 2):
        runs: dict[str, list[tuple[float, float, int]]] = {"default": [], "bpe": []}
        for r in range(rounds):
            for kind in ("default", "bpe") if r % 2 == 0 else ("bpe", "default"):
                runs[kind].append(prepare_throughput(max_chars, workers, out, kind))
        for kind, results in runs.items():
            tokens_s, chars_s = [x[0] for x in results], [x[1] for x in results]
            print(
                f"prepare  {names[kind]:<35} {workers} worker(s): {statistics.median(tokens_s):>10,.0f} tokens/s "
                f"[{min(tokens_s):,.0f}-{max(tokens_s):,.0f}]  {statistics.median(chars_s) / 1e6:.2f} M chars/s "
                f"({results[0][2]:,} tokens, {results[0][2] / max_chars:.3f} per char)"
            )


def main() -> None:
    """Run the three measurements and print the figures and the loader/training ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-chars", type=int, default=8_000_000, help="characters of the default corpus to prepare")
    parser.add_argument("--batches", type=int, default=200, help="loader batches to time")
    parser.add_argument("--steps", type=int, default=5, help="training steps to time")
    parser.add_argument("--rounds", type=int, default=3, help="prepare rounds per tokenizer and worker count")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process, for both tokenizers
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        for kind in ("default", "bpe"):  # warm-up: imports, page cache, tokenizer training (cached afterwards)
            prepare_throughput(args.max_chars, 1, tmp_path, kind)
        print_prepare_rounds(args.max_chars, args.rounds, tmp_path)
        loader = loader_throughput(tmp_path / "run", args.batches)
        train = training_throughput(tmp_path / "run", args.steps)
    print(f"loader   smoke recipe (batch 16 x 128):    {loader:>12,.0f} sequences/s")
    print(f"training smoke model:                      {train:>12,.1f} sequences/s")
    print(f"ratio    loader / training:                {loader / train:>12,.0f}x (target >= 50x)")


if __name__ == "__main__":
    main()
