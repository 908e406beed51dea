"""Owned child processes: die with the parent, whole process groups stopped, readiness waits without sleeps.

Used by every server a lab starts (Triton, Prometheus) and by the distributed launcher's workers.
Linux only where it matters (PR_SET_PDEATHSIG, ``/proc``); elsewhere the functions degrade to no-ops.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import queue
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

_STOP_AT_EXIT: weakref.WeakSet[Any] = weakref.WeakSet()


def stop_at_exit(obj: Any) -> None:
    """Have ``obj.stop()`` called at interpreter exit (a kernel shutdown included) unless it was released first."""
    _STOP_AT_EXIT.add(obj)


def release_at_exit(obj: Any) -> None:
    """``obj`` stopped by itself: nothing left to do for it at exit."""
    _STOP_AT_EXIT.discard(obj)


@atexit.register
def _stop_everything_left() -> None:
    for obj in list(_STOP_AT_EXIT):
        with contextlib.suppress(Exception):
            obj.stop()


def owned_tempdir(prefix: str) -> Path:
    """A temporary folder named ``<prefix><pid>-…`` that is removed at this interpreter's exit.

    A process killed outright (SIGKILL of a kernel or a test worker) runs no exit handler, so each call first
    removes the folders of the same prefix whose owning process is gone: a later run cleans up after it.
    """
    tmp = Path(tempfile.gettempdir())
    for old in tmp.glob(f"{prefix}*") if Path("/proc/self").exists() else ():  # liveness needs /proc
        pid = old.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(old, ignore_errors=True)
    folder = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it, so a busy port is never chosen)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when a server could listen on ``port`` now. The probe binds with SO_REUSEADDR, as Triton, Prometheus
    and Python's HTTP servers do, so a port whose last connections sit in TIME_WAIT (a server just killed) counts
    as free; a port with a listener does not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def die_with_parent() -> None:
    """Linux: ask the kernel to SIGKILL this process when its parent dies, so nothing is orphaned.

    Call it in the child (``preexec_fn``, or first thing in a worker). The kernel delivers the signal when
    the parent *thread* that forked the child exits, which is why :func:`popen_owned` forks from one
    long-lived thread.
    """
    prctl = _prctl()
    if prctl is not None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


_PRCTL: list[Any] = []


def _prctl() -> Any:
    """libc's prctl, looked up once in the parent (a dlopen after fork could deadlock in the child)."""
    if not _PRCTL:
        try:
            _PRCTL.append(ctypes.CDLL("libc.so.6", use_errno=True).prctl)
        except OSError:  # not glibc Linux: children cannot be tied to the parent this way
            _PRCTL.append(None)
    return _PRCTL[0]


_spawn_q: queue.Queue[tuple[Callable[[], Any], queue.Queue[Any]]] = queue.Queue()
_spawner: threading.Thread | None = None
_spawner_lock = threading.Lock()


def _spawner_loop() -> None:
    while True:
        fn, reply = _spawn_q.get()
        try:
            reply.put((True, fn()))
        except BaseException as err:  # handed back to the caller's thread
            reply.put((False, err))


def _in_spawner(fn: Callable[[], Any]) -> Any:
    global _spawner
    with _spawner_lock:
        if _spawner is None or not _spawner.is_alive():
            _spawner = threading.Thread(target=_spawner_loop, name="nvlab-spawner", daemon=True)
            _spawner.start()
    reply: queue.Queue[Any] = queue.Queue()
    _spawn_q.put((fn, reply))
    ok, value = reply.get()
    if not ok:
        raise value
    return value


def popen_owned(argv: list[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen`` in a new session (its own process group) that dies with this interpreter.

    The fork happens in one long-lived daemon thread: PR_SET_PDEATHSIG fires when the *thread* that forked
    the child ends, so a server started from a short-lived thread (a callback, a thread pool) must not be
    forked there.
    """
    kwargs.setdefault("start_new_session", True)
    _prctl()
    kwargs["preexec_fn"] = die_with_parent
    return _in_spawner(lambda: subprocess.Popen(argv, **kwargs))


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``, from ``/proc`` (Linux)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # fields after the ")" that closes the command name: state ppid pgrp ...
        rest = stat[stat.rfind(")") + 2 :].split()
        if len(rest) >= 3 and int(rest[2]) == pgid and rest[0] not in ("Z", "X"):
            out.append(int(d.name))
    return out


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0, kill_wait_s: float = 5.0) -> int | None:
    """SIGTERM the process group of ``proc``, SIGKILL what is left after ``grace_s``; wait until it is empty.

    Safe to call twice and on a process that already exited (its orphaned children are still reaped by
    the group kill). Returns the leader's exit code.
    """
    pgid = proc.pid  # start_new_session: the leader's pid is the group id
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + kill_wait_s
    while True:
        members = group_members(pgid) if os.path.isdir("/proc") else []
        if proc.poll() is None or members:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        try:
            proc.wait(timeout=0.05)
        except subprocess.TimeoutExpired:
            pass
        if proc.poll() is not None and not group_members(pgid):
            return proc.returncode
        if time.monotonic() > deadline:
            return proc.returncode


def wait_http_ok(url: str, proc: subprocess.Popen | None, timeout_s: float, poll_s: float = 0.05,
                 give_up: Callable[[], bool] | None = None) -> bool:
    """Wait until ``GET url`` answers 200, checking that ``proc`` is still alive between tries.

    Returns True when ready, False when ``proc`` exited first or ``give_up()`` says the start has failed
    (a fatal line in the log, say); raises ``TimeoutError`` after ``timeout_s``. The pause between tries is a
    wait on the process itself, so an exit is noticed at once.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            return False
        if give_up is not None and give_up():
            return False
        with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            with urllib.request.urlopen(url, timeout=1.0) as r:
                if r.status == 200:
                    return True
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer 200 within {timeout_s:g} s")
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=poll_s)
        else:
            threading.Event().wait(poll_s)


def tail(path: Path | str | None, n: int = 40) -> str:
    """The last ``n`` lines of a text file ('' when there is none)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 256 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-n:])
