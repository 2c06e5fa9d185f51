"""Data mixtures as text: a weighted blend (``data.blend``) and a blend schedule (``data.blend_schedule``).

Pure parsing, no I/O (the config checks these at the door). A blend is Megatron's
``--data-path`` form, ``"PREFIX"`` or ``"W1 PREFIX1 W2 PREFIX2 ..."``. A blend schedule is phases
separated by ``;``, each ``START: BLEND`` where START is the phase's first step (``900``) or a
percentage of ``train.steps`` (``90%``); the first phase starts at 0 and each runs until the next
starts, e.g. ``"0: 0.7 data/web 0.3 data/code; 90%: 0.4 data/web 0.6 data/hq"`` (the last 10% of
steps on a high-quality mix, as in WSD annealing recipes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessera.data.sources import DataError

SCHEDULE_KEY = "data.blend_schedule"


def parse_weighted(text: str, key: str = "data.blend") -> tuple[list[str], list[float] | None]:
    """``"a"`` -> (["a"], None); ``"0.7 a 0.3 b"`` -> (["a", "b"], [0.7, 0.3]) normalized; errors name ``key``."""
    parts = text.split()
    if not parts:
        raise DataError(f"{key} is empty; write 'PREFIX' or 'W1 PREFIX1 W2 PREFIX2 ...'")
    if len(parts) == 1:
        return parts, None
    if len(parts) % 2:
        raise DataError(
            f"{key} '{text}' has {len(parts)} items; write weight/prefix pairs like '0.7 data/web 0.3 data/code'"
        )
    prefixes, weights = parts[1::2], []
    for raw, prefix in zip(parts[::2], prefixes):
        try:
            weight = float(raw)
        except ValueError:
            raise DataError(
                f"{key}: weight '{raw}' for '{prefix}' is not a number; write weight/prefix pairs like '0.7 "
                "data/web 0.3 data/code'"
            ) from None
        if not math.isfinite(weight) or weight <= 0:
            raise DataError(f"{key}: weight {raw} for '{prefix}' must be a positive number")
        weights.append(weight)
    total = sum(weights)
    return prefixes, [w / total for w in weights]


@dataclass(frozen=True)
class Phase:
    """Steps ``start .. end - 1`` draw from ``prefixes`` by ``weights`` (normalized)."""

    start: int
    end: int
    prefixes: tuple[str, ...]
    weights: tuple[float, ...]


def _phase_start(raw: str, steps: int, where: str) -> int:
    raw = raw.strip()
    try:
        if raw.endswith("%"):
            percent = float(raw[:-1])
            if not 0 <= percent < 100:
                raise ValueError
            return int(percent / 100 * steps)
        return int(raw)
    except ValueError:
        raise DataError(
            f"{SCHEDULE_KEY}: {where} starts at '{raw}'; write a step (e.g. 900) or a percentage of train.steps "
            "below 100 (e.g. 90%)"
        ) from None


def parse_blend_schedule(text: str, steps: int) -> list[Phase]:
    """The phases of ``text`` (see the module doc) over a run of ``steps`` steps."""
    starts: list[int] = []
    blends: list[tuple[list[str], list[float]]] = []
    for n, chunk in enumerate(c for c in text.split(";") if c.strip()):
        where = f"phase {n + 1}"
        if ":" not in chunk:
            raise DataError(
                f"{SCHEDULE_KEY}: {where} '{chunk.strip()}' has no 'START:'; write e.g. '0: 0.7 data/web 0.3 "
                "data/code; 90%: 1 data/hq'"
            )
        start, blend = chunk.split(":", 1)
        starts.append(_phase_start(start, steps, where))
        prefixes, weights = parse_weighted(blend, f"{SCHEDULE_KEY} {where}")
        if len(set(prefixes)) < len(prefixes):
            raise DataError(f"{SCHEDULE_KEY}: {where} names a dataset twice; give each prefix once with its weight")
        blends.append((prefixes, weights or [1.0]))
    if not starts:
        raise DataError(f"{SCHEDULE_KEY} is empty; write e.g. '0: 0.7 data/web 0.3 data/code; 90%: 1 data/hq'")
    if starts[0] != 0:
        raise DataError(f"{SCHEDULE_KEY}: the first phase must start at step 0, not {starts[0]}")
    for n, (a, b) in enumerate(zip(starts, starts[1:] + [steps]), 1):
        if not a < b:
            raise DataError(
                f"{SCHEDULE_KEY}: phase {n} starts at step {a} but the next boundary is {b} (train.steps={steps}); "
                "phases must start at increasing steps below train.steps"
            )
    ends = starts[1:] + [steps]
    return [Phase(a, b, tuple(p), tuple(w)) for a, b, (p, w) in zip(starts, ends, blends)]


def schedule_prefixes(phases: list[Phase]) -> list[str]:
    """Every dataset the schedule names, in order of first appearance."""
    return list(dict.fromkeys(p for phase in phases for p in phase.prefixes))


def overall_weights(phases: list[Phase]) -> list[float]:
    """Each dataset's share of the whole run (phase weights weighted by phase length), in schedule order."""
    shares = dict.fromkeys(schedule_prefixes(phases), 0.0)
    total = phases[-1].end - phases[0].start
    for phase in phases:
        for prefix, weight in zip(phase.prefixes, phase.weights):
            shares[prefix] += weight * (phase.end - phase.start) / total
    return list(shares.values())
