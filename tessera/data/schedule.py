"""``data.blend_schedule``: a training stream whose blend weights change by step ranges.

The schedule (see :mod:`tessera.data.mixture`) is laid out over the run's sample stream: step
``s`` consumes the ``samples_per_step`` (global batch x grad_accum) positions starting at
``s * samples_per_step``, whatever the number of data-parallel ranks. Each phase's positions are
interleaved with megatron-core's greedy ``build_blending_indices`` over that phase's datasets
only, and each dataset keeps one running sample counter across phases, so a dataset used in two
phases continues where it stopped (no sample repeats before its epoch ends). The result is one
index, position -> (dataset, sample), computed once, cached on disk and read by position: the
stream is a pure function of the position, so the loader resumes at any step on any number of
data-parallel ranks. The realized mix of a phase is read from the same index.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from tessera.data.blend import SPLITS, Components, MixedSamples, _save_atomic, blended_split, open_components
from tessera.data.dataset import PackedSplit
from tessera.data.mixture import Phase, overall_weights, schedule_prefixes


def schedule_index(phases: list[Phase], samples_per_step: int, cache: Path) -> tuple[np.ndarray, np.ndarray]:
    """``(dataset_index, sample_index)`` of every stream position of the schedule (see the module doc)."""
    prefixes = schedule_prefixes(phases)
    blob = json.dumps([[p.start, p.end, p.prefixes, p.weights] for p in phases] + [prefixes, samples_per_step])
    key = hashlib.sha256(blob.encode()).hexdigest()[:16]
    which_path, sample_path = cache / f"schedule-{key}-dataset_index.npy", cache / f"schedule-{key}-sample_index.npy"
    if which_path.is_file() and sample_path.is_file():
        return np.load(which_path, mmap_mode="r"), np.load(sample_path, mmap_mode="r")
    from megatron.core.datasets import helpers

    total = phases[-1].end * samples_per_step
    which, sample = np.zeros(total, dtype=np.int16), np.zeros(total, dtype=np.int64)
    drawn = np.zeros(len(prefixes), dtype=np.int64)  # samples taken from each dataset so far
    for phase in phases:
        lo, hi = phase.start * samples_per_step, phase.end * samples_per_step
        local_which, local_sample = np.zeros(hi - lo, dtype=np.int16), np.zeros(hi - lo, dtype=np.int64)
        # Only the phase's own datasets: a zero weight could still win megatron's greedy ties.
        weights = np.asarray(phase.weights, dtype=np.float64)
        helpers.build_blending_indices(local_which, local_sample, weights, len(weights), hi - lo, False)
        to_global = np.asarray([prefixes.index(p) for p in phase.prefixes], dtype=np.int16)
        which[lo:hi] = to_global[local_which]
        sample[lo:hi] = local_sample + drawn[which[lo:hi]]
        drawn += np.bincount(which[lo:hi], minlength=len(prefixes))
    cache.mkdir(parents=True, exist_ok=True)
    _save_atomic(sample_path, sample)
    _save_atomic(which_path, which)
    return which, sample


class ScheduledBlend(MixedSamples):
    """The training split of a blend schedule: stream position ``i`` is one sample (see the module doc)."""

    def __init__(self, parts: Components, phases: list[Phase], samples_per_step: int, cache: Path) -> None:
        self.phases, self.samples_per_step, self.seq_len = phases, samples_per_step, parts.seq_len
        self.prefixes = schedule_prefixes(phases)
        self.dataset_index, self.sample_index = schedule_index(phases, samples_per_step, cache)
        draws = np.bincount(self.dataset_index, minlength=len(self.prefixes))
        order = [parts.prefixes.index(p) for p in self.prefixes]
        self.datasets: list[PackedSplit] = [parts.split(d, 0, int(n) + 1) for d, n in zip(order, draws)]

    def realized_mix(self, phase: int) -> dict[str, float]:
        """Each dataset's share of the samples phase ``phase`` feeds (every rank's together)."""
        p = self.phases[phase]
        counts = np.bincount(
            self.dataset_index[p.start * self.samples_per_step : p.end * self.samples_per_step],
            minlength=len(self.prefixes),
        )
        return {prefix: float(c) / max(int(counts.sum()), 1) for prefix, c in zip(self.prefixes, counts)}

    def phase_report(self, step: int) -> dict | None:
        """After the last step of a phase: the phase, its target weights and the realized mix; else None."""
        ended = [n for n, p in enumerate(self.phases) if p.end == step]
        if not ended:
            return None
        n = ended[0]
        phase = self.phases[n]
        target = dict.fromkeys(self.prefixes, 0.0) | dict(zip(phase.prefixes, phase.weights))
        return {
            "phase": n + 1,
            "steps": [phase.start, phase.end],
            "samples": (phase.end - phase.start) * self.samples_per_step,
            "target": target,
            "realized": self.realized_mix(n),
        }


def format_phase_report(report: dict, phases: int) -> str:
    """One console line for :meth:`ScheduledBlend.phase_report`."""
    mix = ", ".join(
        f"{Path(prefix).name} {100 * share:.1f}% (target {100 * report['target'][prefix]:.1f}%)"
        for prefix, share in report["realized"].items()
    )
    first, end = report["steps"]
    return (
        f"blend phase {report['phase']}/{phases} (steps {first + 1}-{end}, {report['samples']:,} samples) "
        f"realized: {mix}"
    )


def build_scheduled_splits(
    phases: list[Phase],
    split: str,
    seq_len: int,
    seed: int,
    eod: int,
    vocab_size: int,
    cache_dir: Path,
    samples_per_step: int,
) -> dict:
    """Train: the scheduled stream; valid/test: every dataset of the schedule blended by its share of the run."""
    prefixes = schedule_prefixes(phases)
    parts = open_components(prefixes, split, seq_len, seed, eod, vocab_size, cache_dir)
    weights = overall_weights(phases) if len(prefixes) > 1 else None
    out = {name: blended_split(parts, weights, s, cache_dir) for s, name in enumerate(SPLITS) if name != "train"}
    out["train"] = ScheduledBlend(parts, phases, samples_per_step, cache_dir / "indices")
    return out
