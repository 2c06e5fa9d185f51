"""Golden-curve drift: how far the 20-step tiny-recipe curves move across CPU kernel choices.

Runs every tiny recipe (the golden test's overrides, 20 steps) in one subprocess per setting:
torch threads (1, 2) x ATen CPU capability (avx512, avx2, and ``default``: the non-vectorized kernels). Writes, per setting and
family, the loss and grad-norm curves to OUT.json; ``--report OUT.json`` prints the largest
relative difference per step against tests/golden (the numbers the tolerance rule is chosen from).

    python benchmarks/golden_drift.py run OUT.json        # several minutes per setting
    python benchmarks/golden_drift.py report OUT.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# ATEN_CPU_CAPABILITY: avx512 (this machine's own), avx2 (most other x86-64 CPUs), default (ATen's scalar kernels)
SETTINGS = [(t, isa) for isa in ("avx512", "avx2", "default") for t in (1, 2)]
sys.path.insert(0, str(REPO / "tests"))
from helpers.runs import GOLDEN_OVERRIDES as OVERRIDES  # noqa: E402 (tests/ on the path first: the same runs)


def _one_setting(threads: int, out: Path) -> None:
    """Child: every tiny recipe under this process's environment, curves appended to ``out``."""
    from tessera.validate import load_config
    from tessera.train.trainer import train

    curves = {}
    cache = Path(os.environ["TESSERA_CACHE"])
    for recipe in sorted((REPO / "configs" / "tiny").glob("*.toml")):
        with tempfile.TemporaryDirectory() as run:
            cfg = load_config(
                recipe, [*OVERRIDES, f"train.run_dir={run}", f"data.cache_dir={cache}", f"train.threads={threads}"]
            )
            train(cfg)
            records = [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]
            records = [r for r in records if "loss" in r]
            curves[recipe.stem] = {k: [r[k] for r in records[:20]] for k in ("loss", "grad_norm")}
        print(recipe.stem, flush=True)
    out.write_text(json.dumps(curves))


def run(out: Path) -> None:
    """Parent: one child per setting; results merged into ``out``."""
    results = json.loads(out.read_text()) if out.exists() else {}
    cache = tempfile.mkdtemp(prefix="drift_cache")
    for threads, isa in SETTINGS:
        name = f"threads={threads} isa={isa}"
        if name in results:
            continue
        part = out.with_suffix(".part.json")
        env = {**os.environ, "ATEN_CPU_CAPABILITY": isa, "OMP_NUM_THREADS": str(threads), "TESSERA_CACHE": cache}
        subprocess.run([sys.executable, __file__, "child", str(threads), str(part)], env=env, check=True)
        results[name] = json.loads(part.read_text())
        out.write_text(json.dumps(results, indent=1))


def report(out: Path) -> None:
    """Largest relative difference from tests/golden, per family and step range."""
    results = json.loads(out.read_text())
    worst: dict[int, float] = {}
    for name, curves in results.items():
        for family, curve in curves.items():
            golden = json.loads((REPO / "tests" / "golden" / f"{family}.json").read_text())
            for key in ("loss", "grad_norm"):
                rel = [abs(g - w) / abs(w) for g, w in zip(curve[key], golden[key])]
                for step, r in enumerate(rel, 1):
                    worst[step] = max(worst.get(step, 0.0), r)
                print(f"{name:24s} {family:13s} {key:9s} max rel {max(rel):.2e} at step {rel.index(max(rel)) + 1}")
    print("worst relative drift per step over all settings, families, keys:")
    for step, r in sorted(worst.items()):
        print(f"  step {step:2d}: {r:.2e}")


if __name__ == "__main__":
    if sys.argv[1] == "child":
        _one_setting(int(sys.argv[2]), Path(sys.argv[3]))
    elif sys.argv[1] == "run":
        run(Path(sys.argv[2]))
    else:
        report(Path(sys.argv[2]))
