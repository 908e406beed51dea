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


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="process liveness is read from /proc")
def test_python_env_folders_marked_by_a_dead_server_are_stale_beside_a_live_one(tmp_path):
    """A killed kernel's servers leave their marked folders while another (older) Triton runs: the mark decides."""
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout.strip()
    dead, live, used = (tmp_path / f"python_env_{n}" for n in ("dddddd", "llllll", "uuuuuu"))
    for d, pid in ((dead, dead_pid), (live, str(os.getpid())), (used, dead_pid)):
        d.mkdir()
        (d / procs.PYTHON_ENV_OWNER).write_text(pid)
    (used / "env").mkdir()  # an extracted environment: never removed
    assert procs.stale_python_envs(tmp_path) == [dead]


def test_a_killed_kernels_prometheus_ends_and_doctor_removes_its_folder(tmp_path):
    """Lab 05's case: a Jupyter kernel starts Prometheus and is SIGKILLed; the server ends with it (parent-death
    signal), and `nvlab doctor` removes its data folder, which no exit handler could."""
    import signal

    from lab_utils.course.probe import find_prometheus
    from lab_utils.monitoring import prometheus
    from lab_utils.procs import env_flag

    if find_prometheus("prometheus") is None:
        if env_flag(prometheus.REQUIRE_ENV):
            pytest.fail(f"{prometheus.REQUIRE_ENV}=1 but the prometheus binary is not installed")
        pytest.skip("the prometheus binary is not installed (apt-get install prometheus)")
    jupyter_client = pytest.importorskip("jupyter_client")
    # a TMPDIR of the test's own for the kernel and the doctor: every course process sweeps dead owners' folders from
    # its temporary folder, and another worker's did remove this one between the kill and the look (CI, 2 cores)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    km = jupyter_client.KernelManager(kernel_name="python3")
    km.start_kernel(env=env)
    try:
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        out: list[str] = []
        code = ("from lab_utils.monitoring import prometheus\n"
                "p = prometheus.PrometheusServer({}).start()\n"
                "print('PID', p.pid, p.folder)")
        reply = kc.execute_interactive(code, timeout=90, output_hook=lambda m: out.append(
            m.get("content", {}).get("text", "") + "".join(m.get("content", {}).get("traceback", []) or [])))
        text = "".join(out)
        assert reply["content"]["status"] == "ok", text
        pid_text, folder = text.split("PID", 1)[1].split()[:2]
        pid, workdir = int(pid_text), Path(folder)
        kc.stop_channels()
        kernel_pid = km.provisioner.process.pid
        assert workdir.is_dir() and workdir.parent == tmp and f"-{kernel_pid}-" in workdir.name
        os.kill(kernel_pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while procs.pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not procs.pid_alive(pid), "Prometheus outlived the kernel that started it"
        assert workdir.is_dir()  # SIGKILL: no exit handler ran
        doctor = subprocess.run([sys.executable, "-m", "nvlab", "doctor"], capture_output=True, text=True,
                                timeout=120, env=env)
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        assert not workdir.exists() and str(workdir) in doctor.stdout, doctor.stdout  # the doctor names what it removed
    finally:
        if km.is_alive():
            km.shutdown_kernel(now=True)


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="programs and owners are read from /proc")
def test_doctor_ends_a_program_left_running_from_a_dead_owners_folder(tmp_path, monkeypatch, capsys):
    """A python-backend stub whose kernel and server were killed kept running from its folder (seen on a GPU: it
    catches SIGTERM and outlived its group): `nvlab doctor` ends it (SIGKILL after the SIGTERM it ignores), and only
    it, also once its folder was swept."""
    import shutil
    import tempfile

    from nvlab import cli
    from nvlab.ops.notebooks import orphaned_processes

    dead = _dead_pid()
    started = []
    for owner in (dead, os.getpid()):  # the dead owner's program goes; the live owner's stays
        folder = tmp_path / f"nvlab-triton-backends-{owner}-abc_123"
        folder.mkdir()
        shutil.copy(sys.executable, folder / "stub")
        started.append(subprocess.Popen([str(folder / "stub"), "-c", "import signal, time\n"
                                         "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\n"
                                         "time.sleep(120)"], stdout=subprocess.PIPE, start_new_session=True))
    orphan, kept = started
    try:
        assert [p.stdout.readline() for p in started] == [b"up\n", b"up\n"]
        shutil.rmtree(tmp_path / f"nvlab-triton-backends-{dead}-abc_123")  # swept by a later start: still found
        assert [p.pid for p in orphaned_processes(tmp_path)] == [orphan.pid]
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the doctor's temporary folder
        assert cli.main(["doctor"]) == 0
        ended = f"ended 1 process(es) that killed course processes left running: {orphan.pid} {tmp_path}/nvlab-"
        assert ended in capsys.readouterr().out
        # it ignored SIGTERM, so SIGKILL ended it (psutil reaped it: Popen.wait would read 0)
        assert not procs.pid_alive(orphan.pid) and kept.poll() is None
        assert orphaned_processes(tmp_path) == []
    finally:
        for p in started:
            p.kill()
            p.wait()
