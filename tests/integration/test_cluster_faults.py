"""The slow rank and the hung rank are named: one 2-rank gloo world with a slowed forward, then a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers.runs import REPO, write_tiny_recipe

from tessera.parallel.collective_log import describe_hang
from tessera.train.status import run_status
from tessera.train.metrics import read_metrics
from tessera.train.straggler import StragglerDetector

HANG_STEP = 10


def test_describe_hang_names_the_rank_behind_and_the_collective():
    done = {"group": "default_pg", "kind": "all_reduce", "seq": 40, "completed": True}
    stuck = {"group": "default_pg", "kind": "all_gather", "seq": 41, "completed": False}
    (line,) = describe_hang({0: [stuck], 1: [done], 2: [stuck], 3: [stuck]})
    assert line.startswith(
        "group default_pg: rank(s) 1 behind at collective #40; rank(s) 0, 2, 3 wait in #41 all_gather"
    )
    assert describe_hang({0: [done], 1: [done]}) == []  # in step with each other: nothing to name


def test_the_detector_flags_one_rank_slow_in_one_phase_after_three_windows(tmp_path):
    import torch

    detector = StragglerDetector(tmp_path, 1.5, 1, 0, 3, torch.device("cpu"))
    fast = {"step_s": 0.1, "data": 0.001, "forward": 0.02, "backward": 0.05, "optimizer": 0.01, "other": 0.0}
    slow = {**fast, "backward": 0.09}
    flags = [detector._judge(step, [fast, slow, fast]) for step in range(1, 5)]
    assert flags[:2] == [None, None] and flags[3] is None  # flagged once, on the third window in a row
    assert flags[2]["straggler"]["rank"] == 1 and flags[2]["straggler"]["phase"] == "backward"
    assert all(f is None for f in (detector._judge(5, [fast, fast, fast]),))


@pytest.mark.slow
def test_a_slowed_forward_is_flagged_and_a_hang_names_the_rank_behind(tmp_path, cache_dir):
    run = tmp_path / "run"
    recipe = write_tiny_recipe(
        tmp_path / "job.toml",
        cache_dir,
        f"train.run_dir={run}",
        "train.hang_timeout_s=6",
        "train.eval_every=0",
        "train.steps=30",
        "checkpoint.every=100",
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TESSERA_FAULTS": f"slow_forward@1:0.05,hang@1:{HANG_STEP}"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "tessera",
        "train",
        str(recipe),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300, check=False)
    assert result.returncode != 0
    flags = [r for r in read_metrics(run) if "straggler" in r]
    assert flags and flags[0]["straggler"]["rank"] == 1 and flags[0]["straggler"]["phase"] == "forward", flags
    assert flags[0]["step"] <= 5  # within a few steps (3 logging windows of 1 step, plus the first step's warm-up)
    table = json.loads((run / "stragglers.json").read_text())["ranks"]
    assert table[1]["forward"] > table[0]["forward"] + 0.04  # own work: the 50 ms of spinning, on rank 1 only
    assert table[0]["collectives"] > table[1]["collectives"]  # rank 0 waits for rank 1
    assert "<- straggler (forward)" in run_status(run)
    report = (run / "hang" / "report.txt").read_text()
    assert "rank(s) 1 behind" in report and "rank(s) 0 wait in" in report, report
    assert "tessera: hang: group" in result.stderr
