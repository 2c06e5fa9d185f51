"""The straggler table's file and its ``tessera status`` view (no torch import: status stays instant)."""

from __future__ import annotations

from pathlib import Path

from tessera.train.lock import read_json

PHASES = ("data", "forward", "backward", "optimizer", "other")
COMPUTE = PHASES[:4]  # the phases a rank can be slow in (others only wait in them)
TABLE = "stragglers.json"


def status_table(run_dir: str | Path) -> list[str]:
    """``tessera status``'s per-rank table from ``RUN/stragglers.json`` (no lines when absent)."""
    data = read_json(Path(run_dir) / TABLE)
    if not data:
        return []
    cols = ("step_s", *COMPUTE, "collectives")
    lines = [f"per-rank ms per step at step {data['step']} (own work per phase; collectives = time waited)"]
    lines.append("  rank " + " ".join(f"{c:>11}" for c in cols))
    flagged = {int(k): v for k, v in data.get("flagged", {}).items()}
    for rank, entry in enumerate(data["ranks"]):
        mark = f"  <- straggler ({flagged[rank]})" if rank in flagged else ""
        lines.append(f"  {rank:>4} " + " ".join(f"{1e3 * entry[c]:>11.1f}" for c in cols) + mark)
    return lines
