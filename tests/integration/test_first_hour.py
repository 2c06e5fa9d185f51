"""What a new user meets in the first hour: help, threads, MFU, progress, key docs, status, data records."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
from helpers.runs import REPO, TINY_OVERRIDES, run_cli

from tessera.cli import build_parser, main
from tessera.config import ConfigError, JobConfig
from tessera.validate import load_config

# ---------------------------------------------------------------- help of every command


def _all_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _all_parsers(sub, (*path, name))


def test_every_command_and_action_prints_its_help(capsys):
    paths = [path for path, _ in _all_parsers(build_parser())]
    assert ("slurm",) in paths and ("config", "keys") in paths and ("status",) in paths
    for path in paths:
        with pytest.raises(SystemExit) as exit_:
            main([*path, "--help"])
        assert exit_.value.code == 0, path
        assert capsys.readouterr().out.startswith("usage: tessera"), path


def test_train_help_explains_overrides_and_where_the_keys_are(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "model.n_layers=4 or --model.n_layers 4" in out and "tessera config keys [SECTION]" in out


# ---------------------------------------------------------------- threads


def test_thread_choice_prefers_the_key_then_the_environment_then_cores_per_process(monkeypatch):
    from tessera import threads

    monkeypatch.setattr(threads, "usable_cores", lambda: 16)
    monkeypatch.setattr(threads, "other_work", lambda: 0.1)  # an idle 16-core machine
    assert threads.choose_threads(3, 4, {"OMP_NUM_THREADS": "2"}) == threads.ThreadChoice(3, "train.threads")
    assert threads.choose_threads(0, 4, {"OMP_NUM_THREADS": "2"}) == threads.ThreadChoice(2, "OMP_NUM_THREADS")
    assert threads.choose_threads(0, 4, {}) == threads.ThreadChoice(4, "auto: 16 cores / 4 processes")
    assert threads.choose_threads(0, 32, {}).threads == 1
    assert (
        "4 torch threads per process (auto: 16 cores / 4 processes; train.threads sets it)"
        == threads.choose_threads(0, 4, {}).describe()
    )


def test_cores_busy_with_other_work_are_left_to_it(monkeypatch):
    from tessera import threads

    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(threads, "other_work", lambda: 1.0)  # benchmarks/threads.py: 2 threads 2.32x slower here
    assert threads.choose_threads(0, 1, {}) == threads.ThreadChoice(1, "auto: 1.0 of 2 cores busy with other work")
    assert threads.choose_threads(2, 1, {}).threads == 2  # train.threads still wins
    monkeypatch.setattr(threads, "other_work", lambda: 0.2)  # noise: idle, 2 threads are 1.8x faster
    assert threads.choose_threads(0, 1, {}) == threads.ThreadChoice(2, "auto: 2 cores / 1 process")
    monkeypatch.setattr(threads, "usable_cores", lambda: 16)
    monkeypatch.setattr(threads, "other_work", lambda: 4.0)  # 12 free cores for 4 processes
    assert threads.choose_threads(0, 4, {}) == threads.ThreadChoice(3, "auto: 4.0 of 16 cores busy with other work")


def test_other_work_counts_a_busy_process_and_not_this_one(tmp_path):
    import threading

    from tessera import threads

    (tmp_path / "stat").write_text("cpu  100 5 50 800 45 0 0 0 0 0\ncpu0 1 2 3 4\n")
    assert threads._cpu_jiffies(tmp_path / "stat") == (155, 1000)  # idle + iowait are not busy
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        assert threads.other_work() >= 0.5  # one spinning process is most of a core of other work
    finally:
        spinner.kill()
        spinner.wait()
    before = threads.other_work()  # whatever else this machine runs now (the suite may share it)
    stop = threading.Event()
    own = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)])  # this process spins a core
    own.start()
    try:
        assert threads.other_work() < before + 0.5  # this process's own work is not other work
    finally:
        stop.set()
        own.join()


def test_a_busy_machine_gets_a_hint(monkeypatch):
    from tessera import threads

    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(threads, "other_work", lambda: 1.2)
    assert threads.busy_hint(2) == (
        "machine busy (1.2 of 2 cores running other work): if steps are slow, try train.threads=1"
    )
    assert threads.busy_hint(1) == ""
    monkeypatch.setattr(threads, "other_work", lambda: 0.1)
    assert threads.busy_hint(2) == ""


def test_usable_cores_follow_affinity_and_the_cgroup_quota(tmp_path, monkeypatch):
    from tessera import threads

    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads._cgroup_cores(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads._cgroup_cores(tmp_path) is None
    monkeypatch.setattr(threads, "_cgroup_cores", lambda: 1.5)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert threads.usable_cores() == 2


def test_launch_gives_cpu_workers_their_share_of_the_cores(tiny_config, monkeypatch):
    from tessera import threads
    from tessera.launcher.torchrun import thread_env

    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert thread_env(tiny_config("train.device=cpu"), 4) == {"OMP_NUM_THREADS": "2"}
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert thread_env(tiny_config("train.device=cpu"), 4) == {}  # the user's choice stands


def test_negative_threads_are_refused():
    with pytest.raises(ConfigError, match=r"train.threads must be >= 0 \(0 = auto\)"):
        load_config(None, ["train.threads=-1"])


# ---------------------------------------------------------------- MFU and the logging window


def test_logging_window_means_the_loss_smooths_throughput_and_caps_mfu():
    from tessera.train.metrics import StepWindow

    window = StepWindow(flops_per_token=1.0, peak_flops_total=100.0)
    window.add({"loss": 4.0, "lr": 0.1, "grad_norm": 1.0}, tokens=50, seconds=1.0)
    window.add({"loss": 2.0, "lr": 0.2, "grad_norm": 3.0}, tokens=50, seconds=0.25)
    record = window.flush()
    assert record == {"loss": 3.0, "lr": 0.2, "grad_norm": 2.0, "tokens_per_s": 80.0, "mfu": 0.8}
    window.add({"loss": 1.0, "lr": 0.3, "grad_norm": 1.0}, tokens=500, seconds=1.0)
    assert window.flush()["mfu"] == 1.0  # 500 FLOP/s on a 100 FLOP/s peak: the peak was wrong, not the run
    assert window.flush() == {}


def test_cpu_peak_is_measured_once_per_machine_and_thread_count(tmp_path, monkeypatch):
    import torch

    from tessera.train import flops

    probes = []
    monkeypatch.setattr(flops, "measure_cpu_peak_flops", lambda: probes.append(1) or 5e10 * len(probes))
    monkeypatch.setattr(flops, "machine_busy", lambda peers: 5.0)
    busy = (5e10, "measured on a busy machine (5.0 cores of other work), not cached")
    assert flops.peak_flops(torch.device("cpu"), 0.0, tmp_path) == busy
    assert not (tmp_path / "cpu_peak.json").exists()
    probes.clear()
    monkeypatch.setattr(flops, "machine_busy", lambda peers: None)
    first, source = flops.peak_flops(torch.device("cpu"), 0.0, tmp_path)
    assert (first, source) == (5e10, f"measured, cached in {tmp_path / 'cpu_peak.json'}")
    assert flops.peak_flops(torch.device("cpu"), 0.0, tmp_path) == (5e10, f"cached in {tmp_path / 'cpu_peak.json'}")
    assert flops.peak_flops(torch.device("cpu"), 0.0, tmp_path, local_processes=2)[0] == 1e11  # another key
    assert len(probes) == 2 and len(json.loads((tmp_path / "cpu_peak.json").read_text())) == 2
    assert flops.peak_flops(torch.device("cpu"), 7e9, tmp_path) == (7e9, "log.peak_flops")


# ---------------------------------------------------------------- a real tiny run, its records, status


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, cache_dir):
    """A tiny run logged every 3 steps with TensorBoard on, and its per-step losses."""
    from tessera.train.trainer import train

    run_dir = tmp_path_factory.mktemp("first_hour") / "run"
    config = load_config(
        None,
        [
            *TINY_OVERRIDES,
            f"train.run_dir={run_dir}",
            f"data.cache_dir={cache_dir}",
            "train.steps=6",
            "log.every=3",
            "train.eval_every=3",
            "log.tensorboard=true",
        ],
    )
    return run_dir, train(config).losses


def test_logged_loss_is_the_mean_of_its_window_and_tensorboard_tags_are_grouped(finished_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tessera.train.metrics import read_metrics

    run_dir, losses = finished_run
    records = {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}
    assert sorted(records) == [3, 6]
    assert records[3]["loss"] == pytest.approx(sum(losses[:3]) / 3, rel=1e-12)
    assert records[6]["loss"] == pytest.approx(sum(losses[3:]) / 3, rel=1e-12)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "val/loss", "val/ppl", "perf/tokens_per_s", "perf/mfu"} == tags
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([records[3]["loss"], records[6]["loss"]])


def test_status_of_a_finished_run(finished_run):
    run_dir, _ = finished_run
    done = run_cli("status", str(run_dir))
    assert done.returncode == 0, done.stderr
    lines = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in done.stdout.splitlines())
    assert lines["state"] == "finished" and lines["step"] == "6 / 6 (100%)"
    assert lines["tokens seen"] == f"{6 * 4 * 32:,}"  # steps x batch x seq_len
    assert lines["checkpoint"] == f"{run_dir / 'checkpoints' / 'step_00000006'} (step 6)"
    vals = {
        r["step"]: r["val_loss"]
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "val_loss" in r
    }
    best = min(vals, key=vals.get)
    assert lines["val loss"] == f"last {vals[6]:.4f} at step 6; best {vals[best]:.4f} at step {best}"
    assert lines["speed"].endswith("tokens/s") and "ETA" not in lines["speed"]


HOLD = """
import sys, time
from tessera.train.lock import RunLock
lock = RunLock(sys.argv[1]).acquire()
lock.heartbeat(4)
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture
def held_run(finished_run, tmp_path):
    """A copy of the finished run, cut back to step 3, held by another process as a live training would."""
    import shutil

    run_dir = tmp_path / "live"
    shutil.copytree(finished_run[0], run_dir)
    (run_dir / "config.toml").write_text(load_config(run_dir / "config.toml", [f"train.run_dir={run_dir}"]).to_toml())
    records = (run_dir / "metrics.jsonl").read_text().splitlines()
    kept = [line for line in records if json.loads(line)["step"] <= 3]
    shutil.rmtree(run_dir / "checkpoints" / "step_00000006")
    (run_dir / "metrics.jsonl").write_text("\n".join(kept) + '\n{"step": 4, "lo')  # a line being written
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline() == "held\n"
        yield run_dir, holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_status_while_running_names_the_holder_and_an_eta(held_run):
    from tessera.train.status import run_status

    run_dir, pid = held_run
    lines = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in run_status(run_dir).splitlines())
    assert lines["state"].startswith(f"running: pid {pid} on host ") and ", step 4, started " in lines["state"]
    assert lines["step"] == "4 / 6 (67%)" and "ETA " in lines["speed"]


def test_a_running_training_keeps_slurm_and_train_away_from_its_run_dir(held_run, capsys):
    run_dir, pid = held_run
    before = (run_dir / "config.toml").read_text()
    assert main(["slurm", str(run_dir / "config.toml"), "--gpus-per-node", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"tessera: error: train.run_dir '{run_dir}' belongs to a training that is still running (pid {pid} "
    )
    assert (
        err.count("\n") == 1
        and (run_dir / "config.toml").read_text() == before
        and not (run_dir / "job.sbatch").exists()
    )
    assert main(["train", str(run_dir / "config.toml")]) == 2
    assert "belongs to a training that is still running" in capsys.readouterr().err


def test_tessera_train_holds_the_run_from_its_start_and_the_logger_joins_that_hold(tmp_path):
    from tessera.train.lock import run_holder
    from tessera.train.rundir import claim_run
    from tessera.train.status import run_status
    from tessera.train.metrics import MetricsLogger

    run_dir = tmp_path / "claimed"
    with claim_run(run_dir):  # what `tessera train` does before building data and model
        assert run_holder(run_dir).pid == os.getpid()
        state = run_status(run_dir).splitlines()[1]
        assert state.startswith(f"state        starting (preparing data and model): pid {os.getpid()}")
        logger = MetricsLogger(run_dir, 10, "none", tensorboard=False)
        logger.log({"step": 3, "loss": 1.0})
        logger.close()
        assert run_holder(run_dir).step == 3  # the logger leaving does not end the claim
        other = subprocess.run([sys.executable, "-c", HOLD, str(run_dir)], capture_output=True, text=True, cwd=REPO)
        assert other.returncode == 1 and "belongs to a training that is still running (pid" in other.stderr
    assert run_holder(run_dir) is None


def test_a_fresh_heartbeat_from_another_host_counts_as_running_for_slurm_only(tiny_config, tmp_path):
    from tessera.train.lock import LOCK_NAME, refuse_if_running

    run_dir = tmp_path / "remote"
    run_dir.mkdir()
    beat = {
        "pid": 7,
        "host": "n17",
        "started": time.time() - 60,
        "updated": time.time() - 5,
        "step": 9,
        "state": "running",
    }
    (run_dir / LOCK_NAME).write_text(json.dumps(beat))
    with pytest.raises(ConfigError, match=f"pid 7 on host n17, step 9.*delete {run_dir / LOCK_NAME}"):
        refuse_if_running(run_dir, "this job", trust_heartbeat=True)
    refuse_if_running(run_dir, "tessera train")  # a restarted group on another node must not lock itself out
    (run_dir / LOCK_NAME).write_text(json.dumps({**beat, "updated": time.time() - 3600}))
    refuse_if_running(run_dir, "this job", trust_heartbeat=True)  # stale: the job is gone


def test_status_of_a_directory_that_is_not_a_run(tmp_path, capsys):
    assert main(["status", str(tmp_path)]) == 2
    assert "is not a tessera run directory (no config.toml)" in capsys.readouterr().err


# ---------------------------------------------------------------- the progress display


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _records():
    base = {"lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 12345.0, "mfu": 0.031}
    return [
        {"step": 0, "val_loss": 5.0, "val_ppl": 148.4},
        {"step": 5, "loss": 4.5, **base},
        {"step": 10, "loss": 4.0, **base},
    ]


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere(tmp_path):
    from tessera.train.metrics import MetricsLogger

    terminal, pipe = _Terminal(), io.StringIO()
    for stream, run in ((terminal, tmp_path / "tty"), (pipe, tmp_path / "pipe")):
        run.mkdir()
        logger = MetricsLogger(run, 20, "auto", tensorboard=False, stream=stream)
        for record in _records():
            logger.log(record)
        logger.close()
    bar = terminal.getvalue()
    assert "\r" in bar and "step 10/20  50%|" in bar and "| loss 4.0000 | 12.3k tok/s | mfu 3.1% [" in bar
    assert re.search(r"\[\d\d:\d\d<\d\d:\d\d\]", bar), bar  # elapsed < remaining
    assert "step 0/20 | val 5.0000 (ppl 148.4)\n" in bar  # evaluations stay on screen above the bar
    lines = pipe.getvalue().splitlines()
    assert (
        "\r" not in pipe.getvalue()
        and len(lines) == 3
        and lines[2].startswith("step 10/20 | loss 4.0000 | lr 1.00e-03")
    )


# ---------------------------------------------------------------- key documentation


@dataclass
class _Inner:
    """Inner knobs."""

    kind: Literal["a", "b"] = "a"  # which one
    size: int = 3  # how many


@dataclass
class _Outer:
    """Outer section."""

    width: float = 1.5  # a width
    documented: int = field(default=2, metadata={"doc": "from metadata"})
    inner: _Inner = field(default_factory=_Inner)


@dataclass
class _Job:
    outer: _Outer = field(default_factory=_Outer)


def test_key_docs_come_from_the_source_comments_and_recurse_into_sub_sections():
    from tessera.config.docs import sections

    docs = sections(_Job)
    assert [s.name for s in docs] == ["outer", "outer.inner"] and docs[1].doc == "Inner knobs."
    rows = {k.key: (k.type, k.choices, k.value, k.comment) for s in docs for k in s.keys}
    assert rows == {
        "outer.width": ("float", (), 1.5, "a width"),
        "outer.documented": ("int", (), 2, "from metadata"),
        "outer.inner.kind": ("a | b", ("a", "b"), "a", "which one"),
        "outer.inner.size": ("int", (), 3, "how many"),
    }


def _leaf_keys(cls: type, prefix: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += _leaf_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def test_config_keys_lists_every_key_and_each_is_a_real_override():
    from tessera.config.docs import keys_table, sections, toml_value

    table = keys_table()
    every = _leaf_keys(JobConfig, "")
    assert len(every) > 100
    for key in every:
        assert re.search(rf"^  {re.escape(key)} = ", table, re.MULTILINE), key
    for doc in (k for s in sections() for k in s.keys):
        value = doc.value if isinstance(doc.value, str) else toml_value(doc.value)
        assert load_config(None, [f"{doc.key}={value}"]) == JobConfig(), (
            doc.key
        )  # the default, set by its documented name
    assert '  train.dtype = "fp32"' in table and "(one of fp32 | bf16 | fp16)" in table
    undocumented = [k.key for s in sections() for k in s.keys if not k.comment]
    assert not undocumented, f"keys without a comment in tessera/config.py: {undocumented}"


def test_the_docs_example_of_config_keys_is_the_real_output():
    from tessera.config.docs import keys_table

    readme = (REPO / "docs" / "configuration.md").read_text()
    shown = re.search(r"\$ tessera config keys (\S+)\n(.*?)\n```", readme, re.S)
    assert shown is not None and shown.group(2) == keys_table(shown.group(1))


def test_config_keys_cli_filters_and_suggests(capsys):
    assert main(["config", "keys", "train.steps"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[train]") and len(out) == 2 and out[1].startswith("  train.steps = 1000")
    assert main(["config", "keys", "traim"]) == 2
    assert "no config section or key 'traim' (did you mean 'train'?)" in capsys.readouterr().err


def test_print_config_is_a_commented_recipe_that_loads_back(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["train", "configs/smoke.toml", "--print-config", "train.steps=70"]) == 0
    text = capsys.readouterr().out
    assert 'dtype = "fp32"  # fp32 | bf16 | fp16' in text and "# The training loop" in text
    (tmp_path / "printed.toml").write_text(text)
    assert load_config(tmp_path / "printed.toml") == load_config("configs/smoke.toml", ["train.steps=70"])


# ---------------------------------------------------------------- slurm flags describe the job


def test_slurm_asks_for_gpus_even_from_a_machine_without_one(capsys, monkeypatch):
    import torch

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["slurm", "configs/smoke.toml", "--gpus-per-node", "1", "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert "#SBATCH --gres=gpu:1" in captured.out.splitlines()
    assert (
        captured.err.startswith("tessera: notice: the planner's fit check did not run")
        and captured.err.count("\n") == 1
    )
    assert f"PYTHON={sys.executable}" in captured.out and '"$PYTHON" -m torch.distributed.run' in captured.out


# ---------------------------------------------------------------- data: the tokenizer a dataset was made with


def test_prepare_records_the_tokenizer_and_inspect_finds_it(tmp_path, small_tokenizer, cache_dir):
    import shutil

    from tessera.data.inspect import inspect_dataset
    from tessera.data.prepare import file_sha256, prepare_corpus

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": f"def g{i}(y):\n    return y - {i}\n"}) + "\n" for i in range(50)))
    given = tmp_path / "elsewhere" / "tok.model"
    given.parent.mkdir()
    shutil.copyfile(small_tokenizer, given)
    prefix = tmp_path / "out" / "code"
    prepare_corpus(str(rows), prefix, str(given), cache_dir=cache_dir)
    record = json.loads(Path(f"{prefix}.tokenizer.json").read_text())
    assert record == {
        "path": str(given.resolve()),
        "sha256": file_sha256(given),
        "vocab_size": 300,
        "copy": "code.tokenizer.model",
    }
    report = inspect_dataset(prefix)
    assert (
        f"tokenizer   {prefix}.tokenizer.model (sha256 {record['sha256'][:12]}, "
        f"recorded by tessera prepare from {given.resolve()})" in report
    )
    assert "def g49(y):\n      return y - 49" in report
    Path(f"{prefix}.tokenizer.model").unlink()
    assert "def g49(y)" in inspect_dataset(prefix)  # the recorded original, same hash
    given.write_bytes(given.read_bytes() + b"changed")
    report = inspect_dataset(prefix)
    assert "is missing or changed; pass --tokenizer" in report and "token ids (no tokenizer" in report


def test_blend_mix_of_the_first_samples(tmp_path):
    from helpers.data import EOD, write_megatron_dataset

    from tessera.data.blend import build_splits
    from tessera.data.inspect import realized_mix
    from tessera.data.loader import SequenceLoader

    write_megatron_dataset(tmp_path / "web", 600, 10, 100, seed=1)
    write_megatron_dataset(tmp_path / "code", 400, 200, 290, seed=2)
    splits = build_splits(
        f"0.75 {tmp_path / 'web'} 0.25 {tmp_path / 'code'}", "1", 32, 1234, EOD, 300, tmp_path / "cache"
    )
    loader = SequenceLoader(splits["train"], batch_size=4, seed=1234, prefetch=0)
    line = realized_mix(loader, 400)
    assert (
        line == f"data mix of the next 400 samples: {tmp_path / 'web'} 75.0% (weight 75.0%), "
        f"{tmp_path / 'code'} 25.0% (weight 25.0%)"
    )
    assert realized_mix(SequenceLoader(splits["train"].datasets[0], 4, 1234, prefetch=0)) == ""


# ---------------------------------------------------------------- the repository a cloner gets


def test_readme_links_stay_inside_the_repository_and_data_runs_are_ignored():
    readme = (REPO / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if not t.startswith(("http://", "https://"))]
    assert "docs/ARCHITECTURE.md" in local
    for target in local:
        assert (REPO / target).resolve().is_relative_to(REPO) and (REPO / target).exists(), target
    ignored = set((REPO / ".gitignore").read_text().split())
    assert {"/data/", "runs/"} <= ignored and "data/" not in ignored  # "data/" would also hide tessera/data/


# ---------------------------------------------------------------- Weights & Biases, offline, no account


def _wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` file (a LevelDB-style log: 32 KiB blocks of 7-byte-headed chunks)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and length == 0):
            pos += left
            continue
        pending, pos = pending + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_logs_offline_without_an_account(tiny_config, tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    from tessera.train.trainer import train

    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: not logged in
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there
    config = tiny_config(
        "log.wandb=true", "log.wandb_project=first-hour", "train.steps=4", "log.every=2", "log.progress=lines"
    )
    result = train(config)
    assert "wandb: offline (no W&B API key (wandb login))" in capsys.readouterr().out
    run_dir = Path(config.train.run_dir)
    (wandb_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 60  # wandb's service process may still be writing after finish() returns
    records = list(_wandb_records(wandb_file))
    while "exit" not in [r.WhichOneof("record_type") for r in records]:
        assert time.monotonic() < deadline, f"{wandb_file} has no exit record"
        time.sleep(0.2)
        records = list(_wandb_records(wandb_file))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.project, run.display_name, run.run_id) == (
        "first-hour",
        "run",
        (run_dir / "wandb-id.txt").read_text().strip(),
    )
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    logged = {h["step"]: h["train/loss"] for h in history if "train/loss" in h}
    assert logged == pytest.approx({2: sum(result.losses[:2]) / 2, 4: sum(result.losses[2:]) / 2})
    assert {h["step"] for h in history if "val/loss" in h} == {0, 4}


def test_wandb_without_the_package_is_one_clear_line(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    monkeypatch.chdir(REPO)
    assert main(["train", "configs/smoke.toml", "log.wandb=true"]) == 2
    assert (
        capsys.readouterr().err == "tessera: error: log.wandb=true needs the wandb package: "
        "pip install 'tessera[wandb]' (or set log.wandb=false)\n"
    )
