"""DeepSpeed op builds: a dead build's lock is removed (old) or refused in one line (young); a live one is left."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tessera.errors import UserError
from tessera.parallel import ds_ops


def test_a_lock_held_by_a_live_build_is_left_alone(tmp_path):
    lock = tmp_path / "lock"
    build = f"import os, time; os.open({str(lock)!r}, os.O_CREAT | os.O_EXCL); print(1, flush=True); time.sleep(60)"
    # What torch's FileBaton does: create the lock exclusively and keep its fd open while it builds.
    holder = subprocess.Popen([sys.executable, "-c", build], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "1"
        assert ds_ops.lock_holders(lock) == [holder.pid]
        assert ds_ops.check_build_lock(tmp_path, now=time.time() + 10 * ds_ops.STALE_AFTER_S) == ""
        assert lock.exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_dead_builds_lock_is_removed_when_old_and_refused_in_one_line_when_young(tmp_path):
    lock = tmp_path / "lock"
    subprocess.run([sys.executable, "-c", f"import os; os.open({str(lock)!r}, os.O_CREAT | os.O_EXCL)"], check=True)
    assert lock.exists() and ds_ops.lock_holders(lock) == []  # its builder was killed: nobody holds it
    with pytest.raises(UserError) as young:
        ds_ops.check_build_lock(tmp_path)
    assert str(lock) in str(young.value) and "remove the file" in str(young.value) and "\n" not in str(young.value)
    old = time.time() - ds_ops.STALE_AFTER_S - 60
    os.utime(lock, (old, old))
    notice = ds_ops.check_build_lock(tmp_path)
    assert notice.startswith("tessera: removed the stale DeepSpeed build lock") and str(lock) in notice
    assert not lock.exists() and ds_ops.check_build_lock(tmp_path) == ""


def test_the_ops_a_run_builds_are_announced_once_until_built(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert ds_ops.op_names("none", "none", True) == ["deepspeed_shm_comm"]
    assert ds_ops.op_names("cpu", "nvme", False) == ["cpu_adam", "async_io"]
    ds_ops.prepare_builds(["cpu_adam"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "builds its 'cpu_adam' op once" in err and str(tmp_path) in err
    directory = ds_ops.build_directory("cpu_adam")
    (directory / "cpu_adam.so").write_bytes(b"")
    ds_ops.prepare_builds(["cpu_adam"])
    assert capsys.readouterr().err == ""
