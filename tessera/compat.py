"""The compatibility matrix: which features combine with which parallel layouts, read from the registry.

Every component declares the layouts it does not support, with the reason, in its spec
(:mod:`tessera.registry`; the model's next to their code, listed by ``tessera/model/components.py``;
layouts and job-level features in ``tessera/features.py``). Config validation refuses those jobs
before any process starts, and :func:`render_markdown` renders the table into
docs/parallelism/index.md (a test checks the committed copy is current). A layout is the set of
active parallel dimensions of a job; a feature is a row some spec of the job turns on.
"""

from __future__ import annotations

from typing import Any

from tessera import features, registry
from tessera.model import components  # noqa: F401  (registers the zoo's specs)

# The table's columns: the registered layouts, in features.py's order.
LAYOUTS = tuple(spec.name for spec in features.LAYOUTS)
# Row order: job-level features as features.py lists them, then the model's components kind by kind.
ROW_KINDS = ("feature", "option", "position", "attention_kernel", "mixer", "ffn")


def rows() -> dict[str, dict[str, str]]:
    """Row (a spec's ``feature``) -> layout -> reason it is refused, over every registered spec.

    "sp" is tensor parallelism with sequence parallelism on, so it inherits every "tp" entry (a
    job with sp also has tp and is refused there); only what fails with sp alone is listed under "sp".
    """
    table: dict[str, dict[str, str]] = {}
    for kind in ROW_KINDS:
        pool = registry.specs(kind)
        ordered = pool if kind == "feature" else sorted(pool, key=lambda spec: spec.feature.lower())
        for spec in ordered:
            table.setdefault(spec.feature, dict(spec.unsupported or {}))
    return table


def pairs() -> dict[frozenset[str], str]:
    """Pairs of layouts that do not combine, with the reason (the layouts' specs)."""
    found: dict[frozenset[str], str] = {}
    for spec in registry.specs("layout"):
        for other, reason in (spec.unsupported or {}).items():
            found.setdefault(frozenset({spec.name, other}), reason)
    return found


def job_layouts(parallel: Any) -> set[str]:
    """The layouts a ``[parallel]`` section uses.

    Before the world size is known, ``dp_shard = -1`` is unresolved, so the data-parallel layout
    (and "single") is left out; ``layout.check_layout`` asks again with it resolved once the
    launcher knows the world size.
    """
    layouts = set()
    for dim in ("tp", "pp", "cp", "ep"):
        if getattr(parallel, dim) > 1:
            layouts.add(dim)
    if parallel.tp > 1 and parallel.sequence_parallel:
        layouts.add("sp")
    if parallel.engine == "deepspeed":  # ZeRO over every rank; dp_replicate > 1 shows as ddp (refused)
        return layouts | {"deepspeed"} | ({"ddp"} if parallel.dp_replicate > 1 else set())
    dp_shard = parallel.dp_shard
    if dp_shard == -1:  # unknown until the world size is: layout.check_layout resolves it before asking
        return layouts
    sharded = dp_shard * parallel.cp > 1  # FSDP shards parameters over dp_shard x cp
    if parallel.dp_replicate > 1:
        layouts.add("hsdp" if sharded else "ddp")
    elif sharded:
        layouts.add("fsdp")
    return layouts or {"single"}


def job_features(config: Any) -> set[str]:
    """The rows of :func:`rows` a job turns on (the ``feature`` of every spec it uses)."""
    return {spec.feature for spec in registry.used(config)}


def incompatibilities(config: Any) -> list[str]:
    """One message per unsupported (feature, layout) pair of a job; empty when all is supported."""
    layouts = job_layouts(config.parallel)
    table = rows()
    found = []
    for feature in sorted(job_features(config)):
        for layout in sorted(layouts):
            reason = table[feature].get(layout)
            if reason is not None:
                found.append(f"{feature} with {layout}: {reason}")
    for pair, reason in pairs().items():
        if pair <= layouts:
            found.append(f"{' with '.join(sorted(pair))}: {reason}")
    return found


def render_markdown() -> str:
    """The matrix as a Markdown table (the docs' copy is checked against this by a test).

    A layout that cannot train at all shows "n/a" for every other feature; a "no" under
    ``tp`` also shows under ``sp``.
    """
    table = rows()
    missing = table["training"]
    lines = ["| feature | " + " | ".join(LAYOUTS) + " |", "|---" * (len(LAYOUTS) + 1) + "|"]
    for feature, unsupported in table.items():
        refused = set(unsupported) | ({"sp"} if "tp" in unsupported else set())
        cells = ["no" if layout in refused else "n/a" if layout in missing else "yes" for layout in LAYOUTS]
        lines.append(f"| {feature} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"- not {' with '.join(sorted(pair))}: {reason}" for pair, reason in pairs().items()]
    lines += [f"- no {layout}: {reason}" for layout, reason in missing.items()]
    return "\n".join(lines)
