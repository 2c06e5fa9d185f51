"""Goodput: productive time against restarts, recomputed steps, checkpoint stalls and evaluation."""

from __future__ import annotations

import json
import shutil
import time

from tessera.train.status import run_status
from tessera.train.checkpoint import list_checkpoints
from tessera.train.trainer import train


def test_a_restarted_run_counts_its_lost_time_and_recomputed_steps(tiny_config, tmp_path):
    run = tmp_path / "run"
    train(tiny_config("train.steps=6", run_dir=run))
    first = json.loads((run / "summary.json").read_text())["goodput"]
    assert first["sessions"] == 1 and first["recomputed_steps"] == 0 and first["seconds"]["restart"] == 0
    assert first["seconds"]["eval"] > 0 and first["seconds"]["checkpoint"] > 0 and 0 < first["fraction"] < 1
    shutil.rmtree(list_checkpoints(run)[-1])  # as if the process died after step 6, before its save
    time.sleep(1.0)  # the "restart" gap
    train(tiny_config("train.steps=8", run_dir=run))  # resumes at step 4: steps 5 and 6 are trained again
    both = json.loads((run / "summary.json").read_text())["goodput"]
    s = both["seconds"]
    assert both["sessions"] == 2 and both["recomputed_steps"] == 2 and s["recomputed"] > 0
    assert s["restart"] >= 1.0 and s["startup"] > first["seconds"]["startup"]
    assert s["productive"] > first["seconds"]["productive"]
    assert both["fraction"] == round(s["productive"] / sum(s.values()), 4)
    assert json.loads((run / "goodput.json").read_text()) == both
    line = next(x for x in run_status(run).splitlines() if x.startswith("goodput"))
    assert "over 2 session(s)" in line and "2 steps recomputed" in line and "restart" in line
