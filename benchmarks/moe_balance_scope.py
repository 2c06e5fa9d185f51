"""Global-batch vs micro-batch MoE balancing at dp=4, same tokens: validation loss, load imbalance, specialization.

    python benchmarks/moe_balance_scope.py [--steps 200] [--sizes tiny smoke] [--out runs/bench_moe_scope]

Two data sources (domains) are mixed into one training corpus: Python code (this interpreter's standard
library) and prose (the reStructuredText/Markdown documentation installed with site-packages). Each model
is trained twice on exactly the same tokens in the same order:

* ``global``: ``model.moe.aux_loss_scope = "global"`` (the default), the balance loss of the global batch;
* ``micro``: the per-rank loss as four data-parallel ranks compute it. By the parity tests
  (tests/integration/test_parallel_parity.py, tests/integration/test_moe_global_parity.py) a dp=4 run equals one
  process that accumulates four micro-batches of the per-rank size, which is how it runs here (one process,
  so the comparison is not distorted by a loaded machine's timing; only quality is measured).

After training, held-out documents of each domain are routed through the model and reported per scope:
validation loss per domain; load imbalance (max / mean expert load, averaged over MoE layers; 1.0 is even);
and specialization: for each expert, the entropy (bits) of the domain distribution of the tokens routed to it
after correcting for the domains' token counts (1.0 = the expert sees both domains alike, 0.0 = one domain
only), averaged over experts and layers weighted by load. Qwen's "Demons in the Detail" (arXiv 2501.11873)
reports lower entropy (more specialized experts) and lower loss with global-batch balancing.
"""

from __future__ import annotations

import argparse
import json
import math
import site
import sysconfig
from pathlib import Path

import torch

from tessera.model import MoELog
from tessera.train.trainer import Trainer
from tessera.validate import load_config

SIZES = {
    "tiny": [
        "model.dim=64",
        "model.n_layers=2",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.moe.experts=4",
        "model.moe.ffn_hidden=96",
        "train.seq_len=64",
        "train.batch_size=16",
        "model.vocab_size=1024",
    ],
    "smoke": [
        "model.dim=128",
        "model.n_layers=4",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.moe.experts=8",
        "model.moe.ffn_hidden=128",
        "train.seq_len=128",
        "train.batch_size=16",
        "model.vocab_size=2048",
    ],
}
COMMON = [
    "model.arch=decoder",
    "model.activation=swiglu",
    "model.max_seq_len=128",
    "model.moe.top_k=2",
    "model.moe.aux_loss_coef=0.01",
    "model.moe.z_loss_coef=0.001",
    "optim.lr=3e-3",
    "optim.warmup_steps=10",
    "optim.schedule=cosine",
    "train.eval_every=0",
    "train.eval_batches=4",
    "checkpoint.enabled=false",
    "log.every=10",
    "log.progress=none",
    "log.tensorboard=false",
    "log.plot=false",
    "train.sample_tokens=0",
]
DP = 4
CHARS_PER_DOMAIN = 1_500_000


def _gather(files: list[Path], limit: int) -> list[str]:
    texts, total = [], 0
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < 200:
            continue
        texts.append(text)
        total += len(text)
        if total >= limit:
            break
    return texts


def build_corpus(root: Path) -> dict[str, list[str]]:
    """Write the two-domain corpus under ``root/corpus`` (training) and return held-out texts per domain."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    packages = Path(site.getsitepackages()[0])
    prose = sorted([*packages.rglob("*.rst"), *packages.rglob("*.md")])
    domains = {"code": _gather(code, CHARS_PER_DOMAIN), "prose": _gather(prose, CHARS_PER_DOMAIN)}
    held_out = {}
    for name, texts in domains.items():
        folder = root / "corpus" / name
        folder.mkdir(parents=True, exist_ok=True)
        split = len(texts) * 9 // 10  # the last tenth of each domain's files is never trained on
        for i, text in enumerate(texts[:split]):
            (folder / f"{i:05d}.txt").write_text(text)
        held_out[name] = texts[split:]
    return held_out


def _windows(trainer: Trainer, texts: list[str], seq_len: int, count: int) -> torch.Tensor:
    ids = [t for text in texts for t in trainer.data.tokenizer.encode(text)]
    n = min(count, (len(ids) - 1) // (seq_len + 1))
    return torch.tensor(ids[: n * (seq_len + 1)]).view(n, seq_len + 1)


@torch.no_grad()
def evaluate(trainer: Trainer, held_out: dict[str, list[str]], seq_len: int) -> dict:
    """Per-domain loss, and per-layer expert counts per domain, on held-out documents."""
    model = trainer.model
    model.eval()
    counts, losses = {}, {}
    for domain, texts in held_out.items():
        windows = _windows(trainer, texts, seq_len, 64)
        log = MoELog()
        logits = model(windows[:, :-1], moe_log=log)
        losses[domain] = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()
        counts[domain] = torch.stack([s.counts for s in log.layers.values()])  # (layers, E)
    return {"loss": losses, "counts": counts}


def _entropy_bits(p: torch.Tensor) -> torch.Tensor:
    p = p.clamp(min=1e-12)
    return -(p * p.log2()).sum(-1)


def summarize(result: dict) -> dict:
    """Mean loss, imbalance and load-weighted specialization entropy from :func:`evaluate`'s counts."""
    by_domain = torch.stack([result["counts"][d] for d in sorted(result["counts"])], -1)  # (layers, E, domains)
    share = by_domain / by_domain.sum(1, keepdim=True)  # each domain's routing over experts (count-corrected)
    per_expert = share / share.sum(-1, keepdim=True)  # each expert's domain distribution
    load = by_domain.sum(-1) / by_domain.sum((1, 2))[:, None]  # (layers, E)
    entropy = (_entropy_bits(per_expert) * load).sum(-1).mean().item()  # bits (2 domains: 0..1)
    imbalance = (load.max(-1).values * load.shape[-1]).mean().item()
    losses = result["loss"]
    return {
        "val_loss": sum(losses.values()) / len(losses),
        **{f"loss_{d}": v for d, v in losses.items()},
        "imbalance": imbalance,
        "domain_entropy_bits": entropy,
    }


def run(size: str, scope: str, steps: int, root: Path, held_out: dict) -> dict:
    batch = int(next(o for o in SIZES[size] if o.startswith("train.batch_size=")).split("=")[1])
    layout = (
        ["model.moe.aux_loss_scope=global"]
        if scope == "global"
        else [
            "model.moe.aux_loss_scope=micro",
            f"train.batch_size={batch // DP}",
            f"train.grad_accum={DP}",
        ]
    )
    overrides = [
        *COMMON,
        *SIZES[size],
        *layout,
        f"train.steps={steps}",
        f"data.source={root / 'corpus'}",
        f"data.cache_dir={root / 'cache'}",
        f"train.run_dir={root / f'{size}_{scope}'}",
        "data.tokenizer_chars=2000000",
        "train.resume=none",
    ]
    trainer = Trainer(load_config(None, overrides))
    trainer.fit()
    seq_len = int(next(o for o in SIZES[size] if o.startswith("train.seq_len=")).split("=")[1])
    return summarize(evaluate(trainer, held_out, seq_len))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "smoke"], choices=sorted(SIZES))
    parser.add_argument("--out", type=Path, default=Path("runs/bench_moe_scope"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    held_out = build_corpus(args.out)
    rows = []
    for size in args.sizes:
        for scope in ("micro", "global"):
            rows.append({"size": size, "scope": scope, **run(size, scope, args.steps, args.out, held_out)})
            print(json.dumps(rows[-1]), flush=True)
    print("\n| size | scope | val loss | loss code | loss prose | imbalance (max/mean) | domain entropy (bits) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['size']} | {r['scope']} | {r['val_loss']:.4f} | {r['loss_code']:.4f} | {r['loss_prose']:.4f} "
            f"| {r['imbalance']:.3f} | {r['domain_entropy_bits']:.3f} |"
        )
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    assert all(math.isfinite(r["val_loss"]) for r in rows)


if __name__ == "__main__":
    main()
