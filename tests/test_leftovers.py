"""What a killed course process leaves on disk, and who removes it: folders named by their owner's PID, swept
by the next start of anything that makes one and by `nvlab doctor`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab_utils import procs


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not Path(f"/proc/{p.pid}").exists()
    return p.pid


def test_owned_folders_carry_the_pid_and_go_at_the_end_of_their_block():
    folder = procs.owned_tempdir("leftover-test")
    assert folder.name.startswith(f"nvlab-leftover-test-{os.getpid()}-") and folder.is_dir()
    folder.rmdir()
    with procs.temporary_folder("leftover-test") as tmp:
        (tmp / "x").write_text("x")
        assert tmp.name.startswith(f"nvlab-leftover-test-{os.getpid()}-")
    assert not tmp.exists()
    for bad in ("", "Triton", "nvlab-", "a/b", "log-1"):
        with pytest.raises(ValueError, match="lowercase words"):
            procs.owned_tempdir(bad)


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="owner liveness is read from /proc")
def test_a_dead_owners_folders_are_swept_and_a_live_owners_kept(tmp_path):
    dead, live = _dead_pid(), os.getpid()
    gone = tmp_path / f"nvlab-triton-log-{dead}-abc_123"
    kept = tmp_path / f"nvlab-triton-log-{live}-abc_123"
    other = tmp_path / "nvlab-results"  # no owner in the name: never touched
    for d in (gone, kept, other):
        (d / "sub").mkdir(parents=True)
    assert procs.stale_tempdirs(tmp_path) == [gone]
    assert procs.sweep_stale_tempdirs(tmp_path)[-1] == gone
    assert not gone.exists() and kept.is_dir() and other.is_dir()


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="process start times are read from /proc")
def test_python_env_folders_older_than_every_running_triton_are_stale(tmp_path):
    old_empty, old_full = tmp_path / "python_env_aaaaaa", tmp_path / "python_env_bbbbbb"
    old_empty.mkdir()
    (old_full / "env").mkdir(parents=True)
    for d in (old_empty, old_full):
        os.utime(d, (0, 0))  # made in 1970: before any running tritonserver started
    new = tmp_path / "python_env_cccccc"
    new.mkdir()
    stale = procs.stale_python_envs(tmp_path)
    assert old_empty in stale and old_full not in stale  # a folder with files in it is never removed
    started = procs._started_at(os.getpid())
    assert started is not None and abs(started - time.time()) < 24 * 3600
