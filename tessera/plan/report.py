"""The text ``tessera plan`` prints: a ranked table of layouts, what does not fit, how to run the best."""

from __future__ import annotations

from tessera.plan.gpus import GIB, LINK_EFFICIENCY
from tessera.plan.layouts import global_batch
from tessera.plan.measure import Measurement
from tessera.plan.planner import Estimate, Plan

_MEMORY = ("params", "grads", "optim", "activations", "logits", "inflight", "buffers", "runtime")
HEADER = (
    f"{'#':>3}  {'layout':<34} {'ac':<9} {'mb x n':>8} |"
    + "".join(f"{h:>7}" for h in ("params", "grads", "optim", "act", "logits", "pipe", "bufs", "rt"))
    + f" {'total':>7} | {'compute':>8} {'comm':>7} {'bubble':>7} {'step s':>7} | {'tok/s/GPU':>9} {'MFU':>6}"
)


def row(rank: str, e: Estimate) -> str:
    """One table line: the layout, its memory in GiB by kind, its step time split, throughput."""
    lay, mem, speed = e.layout, e.memory, e.speed
    gib = "".join(f"{getattr(mem, k) / GIB:>7.1f}" for k in _MEMORY)
    return (
        f"{rank:>3}  {lay.describe():<34} {lay.ac:<9} {f'{lay.micro_batch} x {lay.microbatches}':>8} |{gib} {mem.total / GIB:>7.1f} | "
        f"{speed.compute:>8.2f} {speed.comm:>7.2f} {speed.bubble:>7.2f} {speed.step:>7.2f} | {speed.tokens_per_s_per_gpu:>9.0f} "
        f"{speed.mfu:>6.1%}"
    )


def _header_lines(p: Plan, config_path: str) -> list[str]:
    g, c = p.gpu, p.config
    calibration = "fitted to published runs" if g.calibrated else "not calibrated: borrowed from H100"
    return [
        f"tessera plan: {config_path} -- {p.shape.total / 1e9:.2f}B parameters ({p.shape.active_matmul / 1e9:.2f}B active in matmuls), "
        f"{global_batch(c)} sequences x {c.train.seq_len} tokens per step, train.dtype={c.train.dtype}",
        f"{p.world} x {g.name} ({g.gpus_per_node} per node, {g.memory / GIB:.1f} GiB): {g.peak_flops / 1e12:.0f} TFLOP/s bf16 peak x "
        f"efficiency {g.efficiency:.2f} ({calibration}); links at {LINK_EFFICIENCY:.0%} of NVLink {g.nvlink / 1e9:.0f} GB/s and "
        f"network {g.network / 1e9:.0f} GB/s per GPU",
    ]


def render(p: Plan, config_path: str, top: int = 10, measured: tuple[Estimate, Measurement] | None = None) -> str:
    """The whole report: header, ranked fitting layouts, the closest misfits, the requested layout, the command."""
    fitting = [e for e in p.estimates if e.fits]
    misfits = [e for e in p.estimates if not e.fits]
    lines = _header_lines(p, config_path)
    lines.append(f"{len(p.estimates)} layouts pass tessera's checks; {len(fitting)} fit. Memory in GiB per GPU, time in seconds per step.")
    lines += ["", HEADER]
    lines += [row(str(i + 1), e) for i, e in enumerate(fitting[:top])]
    if misfits:
        lines += ["", f"do not fit ({len(misfits)}; the {min(len(misfits), 3)} closest):"]
        lines += [row("-", e) + f"   over by {e.over / GIB:.1f} GiB" for e in misfits[:3]]
    if p.requested is not None:
        r = p.requested
        verdict = "fits" if r.fits else f"does NOT fit (over by {r.over / GIB:.1f} GiB)"
        lines += ["", f"the recipe's own layout {verdict}:", row("cfg", r)]
    if measured is not None:
        lines += ["", measure_line(*measured)]
    if fitting:
        lines += ["", "run the top layout with:", f"  tessera launch {config_path} " + " ".join(fitting[0].layout.overrides(global_batch(p.config)))]
    return "\n".join(lines)


def measure_line(e: Estimate, m: Measurement) -> str:
    """Planned vs measured tensor bytes of one layout (the runtime overhead is not a tensor)."""
    planned = e.memory.total - e.memory.runtime
    note = f"; {m.note}" if m.note else ""
    return (
        f"--measure ({e.layout.describe()}, ac={e.layout.ac}): {m.peak / GIB:.2f} GiB of tensors at the peak on fake ranks, "
        f"plan {planned / GIB:.2f} GiB without the runtime overhead ({planned / m.peak - 1:+.1%}); measured in {m.seconds:.0f} s{note}"
    )
