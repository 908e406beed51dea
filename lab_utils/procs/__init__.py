"""Owned child processes: die with the parent, whole process groups stopped, temporary folders swept after a
killed owner.

Used by every server a lab starts (Triton, Prometheus) and by the distributed launcher's workers.
Processes and ports are read through psutil; PR_SET_PDEATHSIG is Linux only (elsewhere a no-op).
The package also holds the course's one reader of environment variables (``procs.env``: ``env_flag``, ``env_int``,
``env_url``) and its ports and HTTP probe (``procs.net``: ``http_ok``, ``check_service``, ``wait_until``), both
importable from here."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import os
import queue
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from lab_utils.procs.env import EnvError, check_url, env_flag, env_int, env_url  # noqa: F401 (the names callers use)
from lab_utils.procs.net import (  # noqa: F401 (the names callers use)
    check_service,
    free_port,
    http_ok,
    port_free,
    wait_http_ok,
    wait_until,
    who_listens,
)

_STOP_AT_EXIT: weakref.WeakSet[Any] = weakref.WeakSet()
_REMOVE_AT_EXIT: list[Path] = []


def stop_at_exit(obj: Any) -> None:
    """Have ``obj.stop()`` called at interpreter exit (a kernel shutdown included) unless it was released first."""
    _STOP_AT_EXIT.add(obj)


def release_at_exit(obj: Any) -> None:
    """``obj`` stopped by itself: nothing left to do for it at exit."""
    _STOP_AT_EXIT.discard(obj)


def remove_at_exit(folder: Path | str) -> None:
    """Have ``folder`` removed at interpreter exit, after what ``stop_at_exit`` holds is stopped."""
    _REMOVE_AT_EXIT.append(Path(folder))


@atexit.register
def exit_cleanup() -> None:
    """What interpreter exit does for the course: stop what ``stop_at_exit`` holds, then remove the
    ``remove_at_exit`` folders (servers first: a running one may still write its log there). A process that ends
    its work before it exits (a test session without workers) may call it then."""
    for obj in list(_STOP_AT_EXIT):
        with contextlib.suppress(Exception):
            obj.stop()
    while _REMOVE_AT_EXIT:
        shutil.rmtree(_REMOVE_AT_EXIT.pop(), ignore_errors=True)


TEMP_PREFIX = "nvlab-"  # every temporary folder of the course: nvlab-<what>-<owner pid>-<random>
OWNED_NAME = re.compile(r"^nvlab-(?:[a-z][a-z0-9_]*-)+?(\d+)-[a-z0-9_]+$")


ENDED = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed but not yet reaped by its parent, does not)."""
    try:
        return pid > 0 and psutil.Process(pid).status() not in ENDED
    except psutil.Error:
        return False


def stale_tempdirs(root: Path | None = None) -> list[Path]:
    """The course's temporary folders whose owning process is gone (killed outright: no exit handler ran).

    Only names of the form ``nvlab-<what>-<pid>-<random>`` count."""
    root = root or Path(tempfile.gettempdir())
    return sorted(path for path in root.glob(f"{TEMP_PREFIX}*") if (m := OWNED_NAME.match(path.name))
                  and path.is_dir() and not path.is_symlink() and not pid_alive(int(m.group(1))))


PYTHON_ENV_OWNER = ".nvlab-owner"  # the pid of the tritonserver whose python backend made the folder


def python_env_unowned(folder: Path) -> bool:
    """A python backend env folder that is empty, or holds only the owner mark of a server that is gone."""
    with contextlib.suppress(OSError, ValueError):
        names = [p.name for p in folder.iterdir()]
        return not names or (names == [PYTHON_ENV_OWNER] and
                             not pid_alive(int((folder / PYTHON_ENV_OWNER).read_text())))
    return False


def stale_python_envs(root: Path = Path("/tmp")) -> list[Path]:
    """Empty ``python_env_*`` folders that no running Triton can own.

    Triton's python backend makes one at a fixed path (``/tmp/python_env_XXXXXX``, not configurable) when it loads, and
    removes it only on a clean shutdown. A folder holding only the course's owner mark whose ``tritonserver`` is gone is
    stale (a killed kernel's servers), and so is an empty one older than every running ``tritonserver``."""
    starts = [p.info["create_time"] or 0.0 for p in psutil.process_iter(["name", "create_time"])
              if p.info["name"] == "tritonserver"]
    oldest = min(starts, default=float("inf"))
    out = []
    for path in root.glob("python_env_*"):
        with contextlib.suppress(OSError):
            if (path / PYTHON_ENV_OWNER).exists():  # the course's servers mark their folder with their pid
                if python_env_unowned(path):
                    out.append(path)
            elif path.is_dir() and not path.is_symlink() and not any(path.iterdir()) and \
                    path.stat().st_mtime < oldest - 1.0:
                out.append(path)
    return sorted(out)


def sweep_stale_tempdirs(root: Path | None = None) -> list[Path]:
    """Remove :func:`stale_tempdirs` and :func:`stale_python_envs`; returns what was removed (``nvlab doctor``
    reports it)."""
    removed = []
    for path in stale_python_envs():
        with contextlib.suppress(OSError):
            (path / PYTHON_ENV_OWNER).unlink(missing_ok=True)
            path.rmdir()
            removed.append(path)
    for path in stale_tempdirs(root):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    return removed


def owned_tempdir(what: str, at_exit: bool = True) -> Path:
    """A new temporary folder ``nvlab-<what>-<pid>-<random>``, removed at this interpreter's exit (``at_exit``).

    A process killed outright runs no exit handler, so each call first sweeps the folders of dead owners: the
    next run of anything in the course cleans up after a killed kernel."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*(-[a-z][a-z0-9_]*)*", what):
        raise ValueError(f"owned_tempdir({what!r}): use lowercase words joined by '-', e.g. 'triton-log'")
    sweep_stale_tempdirs()
    folder = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{what}-{os.getpid()}-"))
    if at_exit:
        remove_at_exit(folder)
    return folder


@contextlib.contextmanager
def temporary_folder(what: str) -> Iterator[Path]:
    """:func:`owned_tempdir` for one block: removed when the block ends (and swept if the process is killed)."""
    folder = owned_tempdir(what, at_exit=False)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def group_listen_ports(pgid: int) -> set[int] | None:
    """TCP ports the live processes of group ``pgid`` listen on; None where psutil may not read their sockets."""
    ports: set[int] = set()
    for pid in group_members(pgid):
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.NoSuchProcess:  # gone meanwhile
            continue
        except psutil.Error:
            return None
        ports |= {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN and c.laddr}
    return ports


def die_with_parent() -> None:
    """Linux: ask the kernel to SIGKILL this process when its parent dies, so nothing is orphaned.

    Call it in the child: first thing in a worker (a Python process the course starts), or as ``preexec_fn`` where
    :func:`popen_owned` finds no ``setpriv``. The kernel delivers the signal when the parent *thread* that forked the
    child exits, which is why :func:`popen_owned` forks from one long-lived thread."""
    if (prctl := _prctl()) is not None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def die_with(pid: int) -> None:
    """SIGKILL this process when process ``pid`` exits (a pidfd watched by a daemon thread; Linux >= 5.3).

    For a child whose parent is not its owner: a rank forked by multiprocessing's forkserver has the forkserver as
    its parent, and the forkserver outlives a killed kernel while its ranks hold the kernel's end of its pipe."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # gone already
        os.kill(os.getpid(), signal.SIGKILL)
    except (AttributeError, OSError):  # no pidfd here: PR_SET_PDEATHSIG (die_with_parent) is all there is
        return

    def wait() -> None:
        select.select([fd], [], [])  # readable once the process has exited
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name=f"nvlab-die-with-{pid}", daemon=True).start()


@functools.cache
def _prctl() -> Any:
    """libc's prctl, looked up once in the parent (a dlopen after fork could deadlock in the child)."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:  # not glibc Linux: children cannot be tied to the parent this way
        return None


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


@functools.cache
def _setpriv() -> str | None:
    """util-linux's ``setpriv`` where it sets the parent-death signal (2.33 and later), else None."""
    path = shutil.which("setpriv")
    if path is None or _prctl() is None:
        return None
    try:
        ok = subprocess.run([path, "--pdeathsig", "KILL", "--", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return path if ok.returncode == 0 else None


def popen_owned(argv: list[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen`` in a new session (its own process group) that dies with this interpreter.

    The fork happens in one long-lived daemon thread: PR_SET_PDEATHSIG fires when the *thread* that forked the child
    ends, so a server started from a short-lived thread (a callback, a thread pool) must not be forked there.
    The signal is set by ``setpriv --pdeathsig KILL``, which then execs ``argv``: no Python runs between the fork and
    the exec. Python there (``preexec_fn``) forks without vfork and runs the parent's fork handlers, and with other
    threads in gRPC calls (a kernel's tritonclient, a test's load) 8 of 477 children aborted before their exec and a
    caller's stream was cut. Without such a setpriv (not util-linux, or older than 2.33) ``preexec_fn`` remains."""
    kwargs.setdefault("start_new_session", True)
    if (setpriv := _setpriv()) is not None:
        _check_runnable(argv[0], kwargs.get("env"), kwargs.get("cwd"))
        argv = [setpriv, "--pdeathsig", "KILL", "--", *argv]
    elif _prctl() is not None:
        kwargs["preexec_fn"] = die_with_parent
    return _in_spawner(lambda: subprocess.Popen(argv, **kwargs))


def _check_runnable(program: str, env: dict[str, str] | None, cwd: str | os.PathLike[str] | None) -> None:
    """Raise what ``Popen`` itself would for a program that is not there (``setpriv`` would only exit 127)."""
    where = os.path.join(cwd, program) if cwd and os.sep in program else program  # a path: from the child's cwd
    if shutil.which(where, path=os.pathsep.join(os.get_exec_path(env))) is None:
        raise FileNotFoundError(2, "No such file or directory, or not executable (on the PATH)", program)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    out = []
    for p in psutil.process_iter(["status"]):
        with contextlib.suppress(OSError):  # gone meanwhile
            if p.info["status"] not in ENDED and os.getpgid(p.pid) == pgid:
                out.append(p.pid)
    return out


def group_still_its(proc: subprocess.Popen) -> bool:
    """Whether process group ``proc.pid`` (``start_new_session``: the leader's pid) can still be ``proc``'s.

    Once the leader is reaped its pid goes back to the system, but not while any process is in its group. So a live
    process holding that pid means the group emptied and the number went to a new process (a session leader of
    another program, another test worker's server): that group is not ours to kill. pid_max is 32768 on many
    machines, and a test run starts tens of thousands of processes."""
    if proc.returncode is None:  # not reaped (running, or a zombie): the number is still the leader's
        return True
    try:
        os.kill(proc.pid, 0)
    except ProcessLookupError:  # nobody has the number: the group, if any, is what the leader left
        return True
    except PermissionError:  # another user's process has it
        return False
    return False


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0, kill_wait_s: float = 5.0) -> int | None:
    """SIGTERM the process group of ``proc``, SIGKILL what is left after ``grace_s``; wait until it is empty.

    Safe to call twice and on a process that already exited (its orphaned children are still reaped by the group
    kill), and never kills a group that took the exited leader's pid afterwards. Returns the leader's exit code."""
    pgid = proc.pid  # start_new_session: the leader's pid is the group id
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    deadline = time.monotonic() + kill_wait_s
    while True:
        members = group_members(pgid) if group_still_its(proc) else []
        if proc.poll() is None or members:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.05)
        if (proc.poll() is not None and not (group_still_its(proc) and group_members(pgid))) or \
                time.monotonic() > deadline:
            return proc.returncode


class Background:
    """``fn(*args, **kwargs)`` running in a daemon thread: its ``result``, or the ``error`` it raised, once it ends."""

    def __init__(self, fn: Callable[..., Any], *args: Any, name: str = "nvlab-background", **kwargs: Any):
        self.result: Any = None
        self.error: BaseException | None = None
        self.ended_at: float | None = None  # time.monotonic() when it returned or raised

        def run() -> None:
            try:
                self.result = fn(*args, **kwargs)
            except BaseException as err:  # handed to the caller's thread
                self.error = err
            self.ended_at = time.monotonic()

        self.thread = threading.Thread(target=run, name=name, daemon=True)
        self.thread.start()

    def get(self) -> Any:
        """Wait until it ends; its result, or its error raised here."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.result


def tail(path: Path | str | None, n: int = 40) -> str:
    """The last ``n`` lines of a text file ('' when there is none)."""
    if path is None:
        return ""
    with contextlib.suppress(OSError), open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 256 * 1024))  # seek returns where it went: the end is the size
        return "\n".join(f.read().decode("utf-8", errors="replace").splitlines()[-n:])
    return ""


# --- a watchdog for a process group: what PR_SET_PDEATHSIG cannot reach ---------------------------------------

# Runs as `python -c` in a session of its own. The owner writes the group id on its stdin (a pipe only the owner
# holds) and "stopped" once it stopped the group itself. End of file without "stopped" means the owner died (a killed
# kernel): PR_SET_PDEATHSIG ended the direct child, not the processes it started (nginx's workers, the uvicorn server
# behind `mlflow server`), so the watchdog ends the whole group and removes the owner's folder.
_GROUP_WATCHDOG = r"""
import os, shutil, signal, sys, time
folder, term_s, kill_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
pgid = sys.stdin.readline().strip()
started = sys.stdin.readline().strip()  # the leader's start time when armed ("": not known here)
rest = sys.stdin.read()

def start_of(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None

if "stopped" not in (pgid, started) and "stopped" not in rest:
    # a live process with the leader's number but another start time: the leader ended, its group emptied and the
    # number went to another program's process, whose group is not ours (pid_max is 32768 on many machines)
    now = start_of(pgid) if pgid.isdigit() else None
    if pgid.isdigit() and (not started or now is None or now == started):
        pgid = int(pgid)
        for sig, wait_s in ((signal.SIGTERM, term_s), (signal.SIGKILL, kill_s)):
            try:
                os.killpg(pgid, sig)
            except OSError:
                break
            end = time.monotonic() + wait_s
            while time.monotonic() < end:
                try:
                    os.killpg(pgid, 0)
                except OSError:
                    break
                time.sleep(0.02)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
"""


def process_start_ticks(pid: int) -> str | None:
    """Linux: when process ``pid`` started (clock ticks after boot, /proc/PID/stat's field 22), which tells a process
    from a later one given the same pid; None elsewhere or when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class GroupWatchdog:
    """Ends a process group and removes ``folder`` (if any) if this interpreter dies without stopping them.

    Start it before the group, ``arm(pgid)`` once the group's leader runs (``start_new_session=True``), and
    ``disarm()`` after stopping the group yourself. ``term_s``/``kill_s``: seconds to wait after SIGTERM, SIGKILL."""

    def __init__(self, folder: str | os.PathLike[str] | None, term_s: float = 1.0, kill_s: float = 2.0):
        read_fd, write_fd = os.pipe()  # close-on-exec: no other child inherits the owner's end
        try:
            self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _GROUP_WATCHDOG, str(folder or ""),
                                          str(term_s), str(kill_s)], stdin=read_fd, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, cwd="/",
                                         start_new_session=True)  # not in the group it may have to kill
        finally:
            os.close(read_fd)
        self._pipe = os.fdopen(write_fd, "w")

    def arm(self, pgid: int) -> None:
        self._pipe.write(f"{pgid}\n{process_start_ticks(pgid) or ''}\n")
        self._pipe.flush()

    def disarm(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._pipe.write("stopped\n")
            self._pipe.flush()
        with contextlib.suppress(OSError):
            self._pipe.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
