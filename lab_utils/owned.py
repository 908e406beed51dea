"""A server this interpreter owns, its lifecycle written once: ports picked (one taken meanwhile: new ones, three
tries), started, ready when its probe answers, stopped with its whole process group (safe twice, and at exit).

A subclass fills in the hooks (``_command``, ``_ready_url``, ``_prepare``, ``error``, ``_failure``...); an exporter
served from a thread overrides the process ones (``_start_once``, ``alive``, ``_cleanup``)."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, TypeVar

from lab_utils.procs import (
    GroupWatchdog,
    free_port,
    group_listen_ports,
    popen_owned,
    port_free,
    release_at_exit,
    stop_at_exit,
    stop_group,
    tail,
    wait_http_ok,
    who_listens,
)

_RUNNING: set[OwnedServer] = set()  # strong references: a server dropped by its caller is still stopped at exit
_running_lock = threading.Lock()
S = TypeVar("S", bound="OwnedServer")
T = TypeVar("T")


class StartStop:
    """``with x:`` runs ``x.start()`` (its result is the ``as`` target) and ``x.stop()`` when the block ends."""

    def __enter__(self: T) -> T:
        return self.start()  # type: ignore[attr-defined]

    def __exit__(self, *exc: Any) -> None:
        self.stop()  # type: ignore[attr-defined]


class OwnedServer(StartStop):
    """One server (a process group, or a thread) owned by this interpreter. Subclasses fill in the hooks."""

    error: type[Exception] = RuntimeError  # what a failed start raises
    name = ""  # the server in messages (default: the class name)
    free_hint = "for a free one"  # how a busy-port message ends
    fallback_port = False  # a busy requested port: a free one instead (``busy_note`` says so), not an error
    busy_note = ""  # "{port} ..." noted in ``self.notes`` when ``fallback_port`` avoids a busy port
    # the free ports of the first start that succeeded are asked for again by every later one (a restart keeps the
    # address); a port lost during that first start still gets new ones
    keep_ports = False
    registered = True  # listed by ``running()`` (a strong reference until stopped); else only stopped at exit
    watchdog_s: tuple[float, float] | None = None  # (SIGTERM, SIGKILL) waits of a GroupWatchdog on ``folder``
    log_mode = "wb"  # how the log is opened at each start ("ab": one log over every start)
    log_lines = 20  # lines of the log in a failed start's message
    poll_s = 0.05  # s between readiness probes

    stop_grace_default_s = 10.0  # ``stop_grace_s=None``: SIGTERM to SIGKILL (s)

    def __init__(self, *, host: str, ports: dict[str, int | None], startup_timeout_s: float = 30.0,
                 stop_grace_s: float | None = None):
        if not (isinstance(startup_timeout_s, (int, float)) and startup_timeout_s > 0):
            raise ValueError(f"startup_timeout_s={startup_timeout_s!r}: a positive number of seconds")
        stop_grace_s = self.stop_grace_default_s if stop_grace_s is None else stop_grace_s
        self.host = host
        self._ports_fixed = dict(ports)  # attribute name -> the port asked for (None: a free one)
        self.startup_timeout_s, self.stop_grace_s = float(startup_timeout_s), float(stop_grace_s)
        self.folder: Path | None = None  # removed at stop
        self.argv: list[str] = []
        self.exit_code: int | None = None
        self.startup_s: float | None = None
        self.notes: list[str] = []
        self._proc: subprocess.Popen | None = None
        self._watchdog: GroupWatchdog | None = None
        self._owner_lock = threading.RLock()

    @classmethod
    def running(cls) -> list[Any]:
        """Servers of this class this process started and has not stopped yet."""
        with _running_lock:
            return [s for s in _RUNNING if isinstance(s, cls)]

    # hooks ----------------------------------------------------------------------------------------------------
    def _check(self) -> None:
        """Refuse a start that cannot succeed, before ports are picked (nothing runs yet)."""

    def _prepare(self) -> dict[str, Any]:
        """Set up one start (folders, config, log); returns more keywords for ``popen_owned`` (env, cwd)."""
        return {}

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _ready_url(self) -> str:
        raise NotImplementedError

    def _log_file(self) -> Path:
        """Where the process writes its output."""
        assert self.log_path is not None
        return self.log_path

    def _give_up(self) -> bool:
        """True when the log shows a start that cannot succeed although the process still runs."""
        return False

    def _started(self) -> None:
        """After the readiness wait, ready or not (what the start left, to clean up at stop)."""

    def _failure(self, timed_out: bool, code: int | None, text: str) -> Exception:
        """The error of a start that timed out, or ended before it was ready (``code``: the exit code, None while it
        runs); ``text`` is the log's tail."""
        how = (f"did not answer within {self.startup_timeout_s:g} s" if timed_out else
               f"exited with code {code} before it answered")
        return self.error(f"{self.name or type(self).__name__} {how}; its log:\n{text}")

    def _port_taken(self, err: Exception) -> bool:
        """Whether a failed start lost its port to another process meanwhile (then new ports are tried)."""
        return "address already in use" in str(err).lower()

    def _busy(self, name: str, port: int) -> Exception:
        return self.error(f"{name}={port} is already in use on {self.host} {who_listens(port)}: pass another port, "
                          f"or None {self.free_hint}")

    def _free_port(self) -> int:
        return free_port(self.host)

    def _halt(self, proc: subprocess.Popen) -> int | None:
        """Stop the process group; its leader's exit code."""
        return stop_group(proc, grace_s=self.stop_grace_s)

    def _cleanup(self) -> None:
        """After the process is stopped: remove what it leaves (each stop calls it; it must be safe twice)."""
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    # state ----------------------------------------------------------------------------------------------------
    @property
    def log_path(self) -> Path | None:
        return self.folder / "server.log" if self.folder else None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def crashed(self) -> str | None:
        """Why the server is broken though its process runs (its log says so), else None."""
        return None

    def alive(self) -> bool:
        """True while the server process runs (it may not be ready yet, or have crashed: ``crashed()``)."""
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the server's log."""
        return tail(self.log_path, n)

    @property
    def stopped(self) -> bool:
        """True once ``stop()`` has stopped the process it started (not when it was never started, or was killed)."""
        return bool(getattr(self._proc, "_nvlab_stopped", False))

    def _state(self) -> str:
        return "running" if self.alive() else ("stopped" if self._proc is not None else "not started")

    # lifecycle ------------------------------------------------------------------------------------------------
    def _pick_ports(self, avoid: set[int]) -> None:
        chosen: list[int] = []
        for name, fixed in self._ports_fixed.items():
            if fixed is not None and not port_free(fixed, self.host):
                if not self.fallback_port:
                    raise self._busy(name, fixed)
                if self.busy_note:
                    self.notes.append(self.busy_note.format(port=fixed))
                fixed = None
            port = self._free_port() if fixed is None else fixed
            while port and (port in chosen or port in avoid):
                port = self._free_port()
            chosen.append(port)
            setattr(self, name, port)

    def _register(self) -> None:
        if self.registered:
            with _running_lock:
                _RUNNING.add(self)
        stop_at_exit(self)

    def start(self: S) -> S:
        """Start on free ports (or those asked for) and wait until ready; ``error`` with the log's tail if not."""
        with self._owner_lock:
            if self.alive() and not self.crashed():
                return self
            if self._proc is not None:
                self.stop()  # what an ended or crashed start left: its process group, folder, watchdog
            self._check()
            avoid: set[int] = set()
            for attempt in range(3):
                self._pick_ports(avoid)
                try:
                    self._start_once()
                except self.error as err:
                    fixed = any(p is not None for p in self._ports_fixed.values())
                    lost = getattr(err, "nvlab_ports_lost", None) or self._port_taken(err)
                    # a crash the server's own start is known to hit now and then (_failure says): the same start
                    # once more
                    transient = getattr(err, "nvlab_transient", False)
                    if attempt == 2 or not (lost or transient) or (lost and fixed and not self.fallback_port):
                        raise
                    if lost:
                        self._ports_fixed = dict.fromkeys(self._ports_fixed)  # taken meanwhile: new free ports
                        avoid |= {getattr(self, name) for name in self._ports_fixed}
                else:
                    if self.keep_ports:
                        self._ports_fixed = {name: getattr(self, name) for name in self._ports_fixed}
                    return self
        raise AssertionError("unreachable")

    def _start_once(self: S) -> S:
        t0 = time.perf_counter()
        ok: bool | None = None
        try:
            popen_kw = self._prepare()
            self.argv = self._command()
            if self.watchdog_s is not None:  # ends what PR_SET_PDEATHSIG misses (the group) if we are killed
                self._watchdog = GroupWatchdog(self._need_folder(), *self.watchdog_s)
            with open(self._log_file(), self.log_mode) as log:
                self._proc = popen_owned(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         **popen_kw)
            if self._watchdog is not None:
                self._watchdog.arm(self._proc.pid)  # start_new_session: the leader's pid is the group id
            self._register()
            ok = wait_http_ok(self._ready_url(), self._proc, self.startup_timeout_s, poll_s=self.poll_s,
                              give_up=self._give_up)
        except TimeoutError:
            ok = None
        except BaseException:
            self.stop()
            raise
        self._started()
        if ok and (lost := self._ports_of_others()):
            # A port picked free was taken before the server could listen on it (another program's own pick of a
            # free port can land there): the readiness answer may have been that program's, and the server has
            # probably exited on its failed bind. New ports are tried.
            holder = who_listens(lost[0])
            self.stop()
            err = self.error(f"{self.name or type(self).__name__}: port {', '.join(map(str, lost))} was taken by "
                             f"another process {holder} before the server could listen on it (address already in "
                             "use); start again for new free ports")
            err.nvlab_ports_lost = lost  # type: ignore[attr-defined]  # start() tries new ports
            raise err
        if not ok:
            assert self._proc is not None
            code = self._proc.returncode
            text = self.log_tail(self.log_lines)
            self.stop()
            raise self._failure(ok is None, code, text)
        self.startup_s = time.perf_counter() - t0
        return self

    def _ports_of_others(self) -> list[int]:
        """This server's ports on which another process listens (none of its own processes does)."""
        if self._proc is None:
            return []
        ours = group_listen_ports(self._proc.pid)
        if ours is None:  # its sockets cannot be read here: nothing to say
            return []
        ports = [getattr(self, name, None) for name in self._ports_fixed]
        # not ours and not free: someone else's (a port not bound yet by a server still starting is free)
        return [p for p in ports if p and p not in ours and not port_free(p, self.host)]

    def _need_folder(self) -> Path | None:
        """The server's folder, which its watchdog removes if this interpreter dies (None: it has none)."""
        return self.folder

    def stop(self) -> int | None:
        """Stop the server (its whole process group) and remove what it leaves; safe twice. Its exit code."""
        with self._owner_lock:
            proc, dog = self._proc, self._watchdog
            if proc is not None and not getattr(proc, "_nvlab_stopped", False):
                self.exit_code = self._halt(proc)
                proc._nvlab_stopped = True  # type: ignore[attr-defined]
            if dog is not None:
                dog.disarm()
                self._watchdog = None
            self._cleanup()
            with _running_lock:
                _RUNNING.discard(self)
            release_at_exit(self)
            return self.exit_code


class HttpGrpcEndpoints:
    """``http_url`` and ``grpc_url`` of a server listening on ``host`` at ``http_port`` and ``grpc_port`` (Triton, and
    nginx in front of it)."""

    host: str
    http_port: int
    grpc_port: int

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """``host:port``: a gRPC target."""
        return f"{self.host}:{self.grpc_port}"


def usable(why: str | None, *, name: str, require_env: str, required: bool, error: type[Exception], skipped: str,
           show: bool = True) -> bool:
    """A component's ``available()``: True when ``why`` (its ``missing()``) is None. Otherwise raises ``error`` when
    ``require_env``=1 (``required``), or prints why, what the lab skips (``show``), and returns False."""
    if why is None:
        return True
    if required:
        raise error(f"{require_env}=1 but {why}")
    if show:
        print(f"{name} is not available here: {why}\n{skipped} Install it and run the lab again.")
    return False
