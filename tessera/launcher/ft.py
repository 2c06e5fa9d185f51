"""``tessera launch --ft-replicas N``: a torchft lighthouse and N replica groups on this machine.

Each replica group is one ``tessera train`` process with ``parallel.fault_tolerance=torchft``, its
``parallel.ft.replica_id`` and its own run directory ``RUN_DIR/replica_<id>`` (the groups hold
identical weights; each writes its own metrics). A group that dies is started again (up to
``--max-restarts`` times in all) while the others train on; the new process receives the live
state from a peer at its first quorum (its earlier ``metrics.jsonl`` is kept as ``metrics.runK.jsonl``).
Every start and exit is a line of ``RUN_DIR/ft_events.jsonl``.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tessera.errors import ConfigError, LaunchError
from tessera.launcher.common import check_world_size, train_args
from tessera.launcher.torchrun import thread_env
from tessera.parallel.ft import lighthouse_url
from tessera.validate import load_config

# The lighthouse forms a quorum without a group whose heartbeats stopped this long ago; it waits this
# long for late joiners once min_replicas are in (short: the survivors' step waits on it).
HEARTBEAT_TIMEOUT_MS = 2000
JOIN_TIMEOUT_MS = 500
USER_ERROR = 2  # a replica's exit code for a user error: restarting cannot help


@dataclass
class Replica:
    """One replica group's process and its starts."""

    group: int
    argv: list[str]
    env: dict[str, str]
    process: subprocess.Popen | None = None
    starts: int = 0
    pids: list[int] = field(default_factory=list)


def replica_overrides(overrides: list[str], run_dir: str, group: int, replicas: int, lighthouse: str) -> list[str]:
    """The ``tessera train`` overrides of replica group ``group``."""
    return [
        *overrides,
        "parallel.fault_tolerance=torchft",
        f"parallel.ft.replicas={replicas}",
        f"parallel.ft.replica_id={group}",
        f"parallel.ft.lighthouse={lighthouse}",
        f"train.run_dir={Path(run_dir) / f'replica_{group}'}",
    ]


def check_replicas(config_path: str, overrides: list[str], replicas: int, lighthouse: str) -> str:
    """The job's run directory, once every replica group's config validates (LaunchError otherwise)."""
    if replicas < 1:
        raise LaunchError(f"--ft-replicas must be >= 1, got {replicas}")
    run_dir = load_config(config_path, overrides).train.run_dir
    try:
        config = load_config(config_path, replica_overrides(overrides, run_dir, 0, replicas, lighthouse))
    except ConfigError as err:
        raise LaunchError(f"--ft-replicas {replicas}: {err}") from None
    check_world_size(config, 1, 1)  # one process per group: the layouts torchft refuses fail here
    return run_dir


def launch_replicas(
    config_path: str, overrides: list[str], replicas: int, max_restarts: int, lighthouse: str, dry_run: bool
) -> int:
    """Start the lighthouse (unless ``lighthouse`` names one) and the groups; restart a dead one; the exit code."""
    address = lighthouse_url(lighthouse, "--ft-lighthouse") if lighthouse else "http://127.0.0.1:29510"
    run_dir = check_replicas(config_path, overrides, replicas, address)
    server = None
    if not lighthouse and not dry_run:
        os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse logs each quorum tick at INFO otherwise
        from torchft.coordination import LighthouseServer

        server = LighthouseServer(
            bind="[::]:0",
            min_replicas=load_config(config_path, overrides).parallel.ft.min_replicas,
            join_timeout_ms=JOIN_TIMEOUT_MS,
            heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
        )
        address = lighthouse_url(server.address())
    group_argv = [
        [sys.executable, *train_args(config_path, replica_overrides(overrides, run_dir, g, replicas, address))]
        for g in range(replicas)
    ]
    print(
        f"tessera: torchft lighthouse {address}, {replicas} replica groups (one process each), "
        f"up to {max_restarts} restarts of a dead group while the others train on",
        flush=True,
    )
    for argv in group_argv:
        print(shlex.join(argv), flush=True)
    if dry_run:
        return 0
    env = thread_env(load_config(config_path, overrides), replicas)  # the cores shared by the groups
    try:
        return _supervise([Replica(g, argv, env) for g, argv in enumerate(group_argv)], Path(run_dir), max_restarts)
    finally:
        if server is not None:
            server.shutdown()


def _supervise(groups: list[Replica], run_dir: Path, max_restarts: int) -> int:
    """Run the groups to the end: a failed one starts again (restarts left), a user error stops all."""
    run_dir.mkdir(parents=True, exist_ok=True)
    supervisor = _Supervisor(groups, run_dir, max_restarts)
    try:
        for group in groups:
            _start(group, supervisor.events)
        while any(g.process is not None for g in groups):
            time.sleep(0.05)
            for group in groups:
                code = group.process.poll() if group.process is not None else None
                if code is not None and (stop := supervisor.exited(group, code)) is not None:
                    return stop
        return 0
    finally:
        for group in groups:
            if group.process is not None:
                group.process.kill()
                group.process.wait()


@dataclass
class _Supervisor:
    groups: list[Replica]
    run_dir: Path
    max_restarts: int
    restarts: int = 0
    finished: bool = False  # a group trained to train.steps: the job is done, nothing restarts

    @property
    def events(self) -> Path:
        return self.run_dir / "ft_events.jsonl"

    def exited(self, group: Replica, code: int) -> int | None:
        """Handle a group's exit; the job's exit code when it must stop now, else None."""
        _record(self.events, {"event": "exit", "group": group.group, "pid": group.process.pid, "code": code})
        group.process = None
        if code == 0:
            self.finished = True
            self._stop_unjoined()
            return None
        if self.finished:
            return None
        if code == USER_ERROR or self.restarts >= self.max_restarts:
            print(f"tessera: replica group {group.group} exited with {code}; stopping the job", flush=True)
            return code if code == USER_ERROR else 1
        self.restarts += 1
        _keep_metrics(self.run_dir / f"replica_{group.group}", group.starts)
        print(
            f"tessera: replica group {group.group} exited with {code}; starting it again "
            f"({self.restarts} of {self.max_restarts} restarts), the others train on",
            flush=True,
        )
        _start(group, self.events)
        return None

    def _stop_unjoined(self) -> None:
        """A restarted group that has not trained a step yet would train alone from its start: stop it."""
        for group in self.groups:
            if group.process is not None and not _has_trained(self.run_dir / f"replica_{group.group}"):
                print(f"tessera: the job finished before replica group {group.group} rejoined; stopping it")
                group.process.terminate()


def _has_trained(replica_dir: Path) -> bool:
    path = replica_dir / "metrics.jsonl"
    return path.is_file() and '"loss"' in path.read_text()


def _keep_metrics(replica_dir: Path, starts: int) -> None:
    """Keep a dead group's metrics.jsonl as metrics.run<starts>.jsonl: its restart begins a new one."""
    path = replica_dir / "metrics.jsonl"
    if path.is_file():
        path.rename(replica_dir / f"metrics.run{starts}.jsonl")


def _start(group: Replica, events: Path) -> None:
    group.process = subprocess.Popen(group.argv, env={**os.environ, **group.env})
    group.starts += 1
    group.pids.append(group.process.pid)
    _record(events, {"event": "start", "group": group.group, "pid": group.process.pid, "start": group.starts})


def _record(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps({**record, "time": time.time()}) + "\n")
