"""Each rank's record of its collectives, from torch's flight recorder (NCCL, and gloo since torch 2.7).

The flight recorder keeps a ring buffer of the last ``TORCH_FR_BUFFER_SIZE`` collectives each
process group issued: kind, per-group sequence number, sizes and whether the work completed.
tessera switches it on before the process group starts (unless the user set the size, 0 = off)
and reads it when a rank hangs: the last collective of each group, and whether it completed, is
what names the rank that is behind (its sequence number is lower) and the collective its peers
wait in. Reading is local: no collective, so it works while the others are stuck.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
DEFAULT_ENTRIES = 2000  # ~ a few steps of FSDP's per-block collectives; each entry is a few hundred bytes


def enable_flight_recorder(entries: int = DEFAULT_ENTRIES) -> None:
    """Record collectives from now on (call before ``init_process_group``; an explicit setting wins)."""
    os.environ.setdefault(FR_BUFFER_ENV, str(entries))


def _entries() -> list[dict[str, Any]]:
    try:
        from torch._C._distributed_c10d import _dump_fr_trace
    except ImportError:  # a torch built without distributed
        return []
    try:
        trace = pickle.loads(_dump_fr_trace(True, False, False))  # collectives, no stack traces, all
    except RuntimeError:  # recorder off or no process group yet
        return []
    return list(trace.get("entries", []))


def last_collectives() -> list[dict[str, Any]]:
    """Per process group, its newest recorded collective: group, kind, sequence number, completed."""
    newest: dict[str, dict[str, Any]] = {}
    for entry in _entries():
        if entry.get("is_p2p"):
            continue
        group = entry["process_group"][1] if entry["process_group"][1] != "undefined" else f"pg{entry['pg_id']}"
        previous = newest.get(group)
        if previous is None or entry["collective_seq_id"] >= previous["seq"]:
            newest[group] = {
                "group": group,
                "kind": entry["profiling_name"].split(":", 1)[-1],
                "seq": int(entry["collective_seq_id"]),
                "completed": entry.get("state") == "completed" or bool(entry.get("retired")),
                "sizes": entry.get("input_sizes", []),
            }
    return sorted(newest.values(), key=lambda e: e["group"])


def describe_hang(per_rank: dict[int, list[dict[str, Any]]]) -> list[str]:
    """Lines naming, per process group, the ranks behind (lowest sequence number) and what the rest wait in."""
    groups: dict[str, dict[int, dict[str, Any]]] = {}
    for rank, entries in per_rank.items():
        for entry in entries:
            groups.setdefault(entry["group"], {})[rank] = entry
    lines = []
    for group, by_rank in sorted(groups.items()):
        seqs = {rank: e["seq"] for rank, e in by_rank.items()}
        waiting = {rank: e for rank, e in by_rank.items() if not e["completed"]}
        if min(seqs.values()) == max(seqs.values()) and not waiting:
            continue
        behind = sorted(r for r, s in seqs.items() if s == min(seqs.values()))
        ahead = max(by_rank.values(), key=lambda e: e["seq"])
        state = "never issued it" if len(set(seqs.values())) > 1 else "issued it too"
        lines.append(
            f"group {group}: rank(s) {', '.join(map(str, behind))} behind at collective #{min(seqs.values())}; "
            f"rank(s) {', '.join(map(str, sorted(waiting)))} wait in #{ahead['seq']} {ahead['kind']} "
            f"(the behind rank(s) {state})"
        )
    return lines
