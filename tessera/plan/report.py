"""The text ``tessera plan`` prints: a ranked table of layouts, what does not fit, how to run the best."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from tessera.plan.gpus import GIB, LINK_EFFICIENCY
from tessera.plan.layouts import global_batch, stage_split_for
from tessera.plan.measure import Measurement
from tessera.plan.planner import Estimate, Plan

_MEMORY = ("params", "grads", "optim", "activations", "logits", "inflight", "buffers", "runtime")
HEADER = (
    f"{'#':>3}  {'layout':<44} {'ac':<9} {'mb x n':>8} |"
    + "".join(f"{h:>7}" for h in ("params", "grads", "optim", "act", "logits", "pipe", "bufs", "rt"))
    + f" {'total':>7} | {'compute':>8} {'comm':>7} {'bubble':>7} {'step s':>7} | {'tok/s/GPU':>9} {'MFU':>6}"
)


def row(rank: str, e: Estimate) -> str:
    """One table line: the layout, its memory in GiB by kind, its step time split, throughput."""
    lay, mem, speed = e.layout, e.memory, e.speed
    cut = f"{lay.micro_batch} x {lay.microbatches}"
    gib = "".join(f"{getattr(mem, k) / GIB:>7.1f}" for k in _MEMORY)
    time = f"{speed.compute:>8.2f} {speed.comm:>7.2f} {speed.bubble:>7.2f} {speed.step:>7.2f}"
    return (
        f"{rank:>3}  {lay.describe()[:44]:<44} {lay.ac:<9} {cut:>8} |{gib} {mem.total / GIB:>7.1f} | {time} | "
        f"{speed.tokens_per_s_per_gpu:>9.0f} {speed.mfu:>6.1%}"
    )


def _header_lines(p: Plan, config_path: str) -> list[str]:
    g, c, shape = p.gpu, p.config, p.shape
    calibration = "fitted to published runs" if g.calibrated else "not calibrated: borrowed from H100"
    model = f"{shape.total / 1e9:.2f}B parameters ({shape.active_matmul / 1e9:.2f}B active in matmuls)"
    batch = f"{global_batch(c)} sequences x {c.train.seq_len} tokens per step, train.dtype={c.train.dtype}"
    machine = f"{p.world} x {g.name} ({g.gpus_per_node} per node, {g.memory / GIB:.1f} GiB)"
    links = f"links at {LINK_EFFICIENCY:.0%} of NVLink {g.nvlink / 1e9:.0f} GB/s, network {g.network / 1e9:.0f} GB/s"
    peak = f"{g.peak_flops / 1e12:.0f} TFLOP/s bf16 peak x efficiency {g.efficiency:.2f} ({calibration})"
    return [
        f"tessera plan: {config_path} -- {model}, {batch}",
        f"{machine}: {peak}; {links}",
    ]


def render(
    p: Plan,
    config_path: str,
    top: int = 10,
    measured: tuple[Estimate, Measurement] | None = None,
    overrides: Sequence[str] = (),
) -> str:
    """The whole report: header, ranked fitting layouts, the closest misfits, the requested layout, the command
    (with the user's ``overrides`` that the layout does not set)."""
    fitting = [e for e in p.estimates if e.fits]
    misfits = [e for e in p.estimates if not e.fits]
    lines = _header_lines(p, config_path)
    lines.append(
        f"{len(p.estimates)} layouts pass tessera's checks; {len(fitting)} fit. "
        "Memory in GiB per GPU, time in seconds per step."
    )
    if p.cut:
        lines.append(f"note: {p.cut}")
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
        lines += ["", "run the top layout with:", "  " + run_command(p, config_path, fitting[0], overrides)]
    return "\n".join(lines)


def run_command(p: Plan, config_path: str, e: Estimate, user: Sequence[str] = ()) -> str:
    """``tessera launch`` (one node) or ``tessera slurm`` (several) with the user's overrides the plan was made
    with, then the layout's (they replace the user's for the keys they set; so does the stage split)."""
    layout = e.layout.overrides(global_batch(p.config))
    if p.config.parallel.layers_per_stage:  # "cost" fits any layout; an explicit list only its own stage count
        layout.append(f"parallel.layers_per_stage={stage_split_for(p.config, e.layout)}")
    keys = {o.split("=", 1)[0] for o in layout}
    kept = [o for o in user if o.split("=", 1)[0] not in keys]
    overrides = " ".join(shlex.quote(o) for o in [*kept, *layout])
    per_node = p.gpu.gpus_per_node
    if p.world <= per_node or p.world % per_node:
        return f"tessera launch {config_path} --nproc-per-node {p.world} {overrides}"
    nodes = f"--nodes {p.world // per_node} --gpus-per-node {per_node} --gpu {p.gpu.name.lower()}"
    return f"tessera slurm {config_path} {nodes} {overrides}"


def measure_line(e: Estimate, m: Measurement) -> str:
    """Planned vs measured tensor bytes of one layout (the runtime overhead is not a tensor)."""
    planned = e.memory.total - e.memory.runtime
    note = f"; {m.note}" if m.note else ""
    return (
        f"--measure ({e.layout.describe()}, ac={e.layout.ac}): {m.peak / GIB:.2f} GiB of tensors at the peak on fake "
        f"ranks, plan {planned / GIB:.2f} GiB without the runtime overhead ({planned / m.peak - 1:+.1%}); "
        f"measured in {m.seconds:.0f} s{note}"
    )
