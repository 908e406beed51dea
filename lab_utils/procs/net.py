"""Ports and HTTP: a free port, who holds a taken one, the course's one HTTP probe (``http_ok``,
``check_service``) and waits without sleeps (``wait_until``, ``wait_http_ok``)."""

from __future__ import annotations

import contextlib
import http.client
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

import psutil


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it, so a busy port is never chosen)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def who_listens(port: int) -> str:
    """``by pid N (command)`` of the process listening on TCP ``port``, for a message about a taken port; where this
    user may not see it, how to find out."""
    try:
        listeners = [c.pid for c in psutil.net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid]
    except psutil.Error:  # a system that shows other processes' sockets only to root
        listeners = []
    for pid in listeners:
        with contextlib.suppress(psutil.Error):  # gone meanwhile
            cmd = " ".join(psutil.Process(pid).cmdline())
            return f"by pid {pid} ({cmd[:100] or pid})"
    return f"(see `ss -ltnp 'sport = :{port}'`)"


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

def http_ok(url: str, timeout_s: float = 2.0, check: Callable[[bytes], bool] | None = None) -> tuple[bool, str]:
    """GET ``url`` once, waiting at most ``timeout_s`` seconds: (answered 200, what happened).

    What happened is ``"HTTP <status>"`` whenever an HTTP answer came (``"HTTP 200, unexpected body ..."`` when
    ``check(body)`` refuses it), else the failure's name: ``ConnectionRefusedError``, ``TimeoutError``,
    ``gaierror`` (unknown host), ``BadStatusLine`` (something that does not speak HTTP)..."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            status = r.status
            body = r.read(65536) if check is not None else b""
    except urllib.error.HTTPError as err:
        err.close()  # it holds the connection open
        return False, f"HTTP {err.code}"
    except urllib.error.URLError as err:
        reason = err.reason
        return False, type(reason).__name__ if isinstance(reason, BaseException) else str(reason)
    except (OSError, http.client.HTTPException, ValueError) as err:  # ValueError: not a URL urllib can open
        return False, type(err).__name__
    if status != 200:
        return False, f"HTTP {status}"
    if check is not None:
        try:
            fits = bool(check(body))
        except Exception:  # a body the check cannot parse is not the expected one
            fits = False
        if not fits:
            return False, f"HTTP 200, unexpected body {body[:80]!r}"
    return True, "HTTP 200"


_NOT_HTTP = ("BadStatusLine", "LineTooLong", "IncompleteRead", "UnknownProtocol", "HTTPException")


def check_service(url: str, path: str, looks_right: Callable[[bytes], bool], what: str, env: str | None = None,
                  wait_s: float = 5.0, poll_s: float = 0.2, hint: str = "") -> str | None:
    """None when ``GET url+path`` answers 200 with a body ``looks_right`` accepts (``url`` is ``what``, Triton or
    Prometheus); else why not, in words naming ``env``, the variable the URL came from (``hint`` follows when
    nothing answers).

    An HTTP answer that is not ``what``'s is reported at once; no answer at all (refused, timed out) and HTTP 503
    (starting) are retried for ``wait_s`` seconds first, for a server still starting."""
    where = urllib.parse.urlsplit(url).netloc or url
    src = f" ({env})" if env else ""
    deadline = time.monotonic() + wait_s
    while True:
        left = deadline - time.monotonic()
        ok, why = http_ok(url.rstrip("/") + path, timeout_s=min(2.0, max(0.5, left)), check=looks_right)
        if ok:
            return None
        late = time.monotonic() >= deadline
        if why == "HTTP 503":  # Service Unavailable: a server still starting, or something else; wait first
            if late:
                return f"{where} answers HTTP but is not {what}, or is not ready: GET {path} gave {why}{src}"
        elif why.startswith("HTTP "):
            return f"{where} answers HTTP but is not {what}: GET {path} gave {why}{src}"
        elif why in _NOT_HTTP:
            return f"{where} answers but does not speak HTTP ({why}): it is not {what}{src}"
        elif why == "gaierror":
            return f"the host in {url} is not known (no DNS entry){src}"
        elif late:
            tip = f": {hint}" if hint else ""
            if why == "ConnectionRefusedError":
                return f"nothing listens at {where}{src}{tip}"
            if why in ("TimeoutError", "timeout"):
                return f"nothing answers at {where} within {wait_s:g} s{src}{tip}"
            return f"nothing answers HTTP at {where} ({why}){src}{tip}"
        threading.Event().wait(min(poll_s, max(0.0, deadline - time.monotonic())))


def wait_until(condition: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> bool:
    """Ask ``condition()`` every ``poll_s`` s until it holds (True) or ``timeout_s`` s have passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        threading.Event().wait(poll_s)
    return True


def wait_http_ok(url: str, proc: subprocess.Popen | None, timeout_s: float, poll_s: float = 0.05,
                 give_up: Callable[[], bool] | None = None) -> bool:
    """Wait until ``GET url`` answers 200, checking that ``proc`` is still alive between tries.

    Returns True when ready, False when ``proc`` exited first or ``give_up()`` says the start has failed
    (a fatal line in the log, say); raises ``TimeoutError`` after ``timeout_s``. The pause between tries is a
    wait on the process itself, so an exit is noticed at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        if (proc is not None and proc.poll() is not None) or (give_up is not None and give_up()):
            return False
        if http_ok(url, timeout_s=1.0)[0]:
            return True
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer 200 within {timeout_s:g} s")
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=poll_s)
        else:
            threading.Event().wait(poll_s)
