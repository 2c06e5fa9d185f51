"""Where a Trainer step spends its time: a few ``Trainer.train_step()`` calls under torch.profiler.

Same shape and switches as ``benchmarks/throughput.py`` (dim 256, 4 layers, vocab 32k, 4x256
tokens, fp32, 1 thread by default). After ``--warmup`` untraced steps, ``--steps`` steps are traced;
the Chrome trace goes to ``profiles/`` (ignored by git; open it in chrome://tracing or Perfetto) and
the top ops by self time are printed (self CPU time; self device time on CUDA), with each op's share
of the traced total.

    python benchmarks/profile_step.py                                    # tessera's defaults
    python benchmarks/profile_step.py --no-fused --adamw for-loop --compile false   # before issue 18
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import shape_parser, tessera_trainer  # a sibling script, not a package

OUT = Path(__file__).resolve().parent.parent / "profiles"


def top_ops(prof: profile, n: int, device: bool) -> list[tuple[str, float, float, int]]:
    """(op, self ms per step, share of all self time, calls) of the ``n`` ops with the most self time."""
    events = prof.key_averages()
    attr = "self_device_time_total" if device else "self_cpu_time_total"
    total = sum(getattr(e, attr) for e in events) or 1.0
    ranked = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:n]
    return [(e.key, getattr(e, attr) / 1e3, getattr(e, attr) / total, e.count) for e in ranked]


def main() -> None:
    """Build the Trainer, warm it up, trace ``--steps`` steps, write the trace, print the top ops."""
    p = shape_parser(__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="traced steps")
    p.add_argument("--warmup", type=int, default=2, help="untraced steps first (compilation, optimizer state)")
    p.add_argument("--top", type=int, default=5)
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        step = tessera_trainer(args, Path(tmp))
        torch.set_num_threads(args.threads)
        for _ in range(args.warmup):
            step()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                step()
            if cuda:
                torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / args.steps
    OUT.mkdir(exist_ok=True)
    name = f"step_{args.dtype}_fused{int(args.fused)}_{args.adamw}_compile-{args.compile}.json"
    prof.export_chrome_trace(str(OUT / name))
    print(
        f"threads={args.threads} torch={torch.__version__} {args.device} {args.dtype} dim={args.dim} "
        f"layers={args.layers} vocab={args.vocab} tokens={args.batch}x{args.seq} fused_loss={args.fused} "
        f"adamw={args.adamw} compile={args.compile}: {seconds:.3f} s/step traced; trace {OUT / name}"
    )
    what = "self device" if cuda else "self CPU"
    print(f"top {args.top} ops by {what} time (per traced step):")
    for key, ms, share, calls in top_ops(prof, args.top, cuda):
        print(f"  {key:<45} {ms / args.steps:9.1f} ms {share:6.1%}  {calls // args.steps} calls")


if __name__ == "__main__":
    main()
