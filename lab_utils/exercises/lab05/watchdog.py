"""Lab 05's q5: a watchdog loop, graded against a real Triton server that the check kills, hangs and makes fail to
restart. The course's tests grade wrong watchdogs against a stand-in process (``watched_server`` patched here)."""

from __future__ import annotations

import contextlib
import functools
import http.client
import os
import signal
import threading
import time
import urllib.error
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lab_utils.exercises.framework import (
    CodeExercise,
    NotApplicable,
    References,
    StudentLine,
    StudentThread,
    StudentTimeout,
    Wrong,
    raised_message,
)
from lab_utils.procs import owned_tempdir, wait_until
from lab_utils.serving import repository as triton_repo
from lab_utils.serving import server as triton_server

# What the check passes to the student's watchdog: short times, so that the whole check takes seconds.
WATCHDOG_SETTINGS = {"poll_s": 0.1, "timeout_s": 1.0, "failures": 2, "backoff_s": 0.1, "max_backoff_s": 2.0}
_CALL = "watchdog(server, stop, " + ", ".join(f"{k}={v:g}" for k, v in WATCHDOG_SETTINGS.items()) + ")"
# The bounds are generous: a verdict never depends on how loaded the machine is. A right watchdog restarts a
# killed or hung server within about a second, and returns within a poll after stop is set.
_HEALTHY_S = 0.8  # a ready server must not be restarted in this long
_QUIET_S = 0.8  # nor again in this long once it is back
_RESTART_WITHIN_S = 20.0  # a killed server restarted within this
_HUNG_WITHIN_S = 8.0  # a hung server (accepts connections, never answers) restarted within this
_READY_WITHIN_S = 120.0  # the restarted server ready again (the restart itself starts Triton)
_STORM_S = 3.0  # restarts failing: the attempts are counted over this long
_STORM_MAX = 7  # exponential backoff from 0.1 s tries about 5 times in 3 s; a fixed pause or none, 10 or more
_STOP_WITHIN_S = 5.0  # stop set -> the function returned


@functools.cache
def _watchdog_repo() -> Path:
    """A repository with the course's small python-backend model on its NumPy engine (4 -> 3 features; written once
    per process, removed at exit): the server the watchdog watches loads a model, as a real one does."""
    repo = owned_tempdir("watchdog") / "repo"
    config = triton_repo.mlp_config("watched", in_features=4, out_features=3, max_batch_size=8, engine="numpy")
    triton_repo.write_python_model(repo, config, sizes={})  # save_mlp_weights' sizes: 4 -> 8 -> 3
    return repo


def watched_server() -> Any:
    """The real Triton server the watchdog watches, on the ports of its first start (its address survives a
    restart; a port taken during that first start gets new ones). The course's tests grade wrong watchdogs against a
    stand-in process with the same ``start/stop/restart/alive/ready/pid`` and ``http_url``."""
    return triton_server.TritonServer(_watchdog_repo(), keep_ports=True, startup_timeout_s=_READY_WITHIN_S,
                                      stop_grace_s=0.2)


class _Rig:
    """The check's Triton server (its ports kept, so its address survives a restart) and what a restart does in
    each phase: really restart it, or (``failing``) stop what is left and fail, as a start whose port is still
    taken."""

    def __init__(self) -> None:
        self.server = watched_server()
        self.failing = False
        self.calls: list[list[Any]] = []  # [monotonic time of the call, whether the restart worked (None: under way)]
        self._lock = threading.Lock()
        self._closed = False

    def restart(self) -> None:
        with self._lock:
            if self._closed:
                raise StudentTimeout()  # the check is over: this ends the student's loop
            call = [time.monotonic(), None]  # counted from the moment it is asked for
            self.calls.append(call)
            try:
                if self.failing:
                    if self.server.alive():
                        self.signal(signal.SIGCONT)  # a stopped process handles no SIGTERM: let stop() end it
                    self.server.stop()
                    raise triton_server.ServerStartError(
                        "tritonserver exited with code 1 before it was ready (the port is still taken by the old "
                        "process)")
                self.server.restart()
            except BaseException:
                call[1] = False
                raise
            call[1] = True

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the server's main process (SIGKILL: a crash; SIGSTOP: a hang)."""
        pid = self.server.pid
        if pid is None or pid <= 0:
            raise RuntimeError("the check's server has no process")
        os.kill(pid, sig)

    def busy(self) -> bool:
        """True while a restart is under way."""
        return self._lock.locked()

    def close(self) -> None:
        """No restart from now on (waits for one under way); stop the server and everything it started."""
        with self._lock:
            self._closed = True
        if self.server.alive():  # a stopped ("hung") server must be able to exit
            with contextlib.suppress(OSError):
                self.signal(signal.SIGCONT)
        self.server.stop()


class WatchedServer:
    """The server as the student's watchdog sees it: ``http_url`` and ``restart()``, as a ``TritonServer`` has."""

    def __init__(self, rig: _Rig):
        self._rig = rig
        self.http_url = rig.server.http_url  # once started: the address every restart keeps

    def restart(self) -> WatchedServer:
        """Stop the server (if it still runs) and start it again; raises when the start fails."""
        self._rig.restart()
        return self

    def __repr__(self) -> str:
        return f"<the check's Triton server at {self.http_url}>"


class _StudentLoop(StudentThread):
    """The student's watchdog running in a thread until ``stop`` is set."""

    def __init__(self, fn: Callable[..., Any], server: WatchedServer, stop: threading.Event):
        self.last_seen: StudentLine | None = None  # where it was when it had to be interrupted
        self.started = time.monotonic()
        self.stop = stop
        super().__init__(fn, server, stop, name="student watchdog", **WATCHDOG_SETTINGS)

    def at(self) -> str:
        line = self.where() if self.thread.is_alive() else self.last_seen
        return f" (it was at {line})" if line else ""

    def ended(self) -> Wrong | None:
        """Why the loop is over while it should still watch; None while it runs (or when the check ended it)."""
        if self.thread.is_alive() or isinstance(self.error, StudentTimeout):
            return None
        err = self.error
        if err is None:
            after = (self.ended_at or time.monotonic()) - self.started
            return Wrong(f"{_CALL} returned after {after:.1f} s, while the server still needed watching: loop until "
                         "`stop` is set (while not stop.is_set(): ...)")
        message = raised_message(_CALL, err)
        if isinstance(err, (OSError, http.client.HTTPException)) and not isinstance(err, urllib.error.URLError):
            message += (". urlopen raises URLError only for what fails before the request is sent; a timeout or a "
                        "connection closed while waiting for the answer raises TimeoutError or ConnectionError: "
                        "catch OSError (URLError, HTTPError, refused connections and timeouts all are one)")
        elif isinstance(err, triton_server.ServerStartError):
            message += (". A restart can fail (the port still taken, a model that does not load): catch the "
                        "error, back off and try again")
        return Wrong(message)

    def wait(self, condition: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until ``condition()`` holds (True) or ``timeout_s`` passes (False); Wrong when the loop ends."""
        def holds() -> bool:
            if condition():
                return True
            gone = self.ended()
            if gone is not None:
                raise gone
            return False

        return wait_until(holds, timeout_s, 0.02)

    def end(self, timeout_s: float) -> None:
        """Set stop and wait for the loop; a loop that does not return is interrupted (best effort)."""
        self.stop.set()
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            self.last_seen = self.interrupt()
            self.thread.join(2.0)


def _server_unavailable() -> str | None:
    try:
        triton_server.find_server(local=True)
    except triton_server.ServerNotFound as err:
        return "this check runs your watchdog against a real Triton server, and there is none here. " + \
            str(err).splitlines()[0]
    return None


def _grade_watchdog(fn: Callable[..., Any]) -> str:
    rig = _Rig()
    try:
        rig.server.start()
    except Exception as err:
        rig.close()
        raise NotApplicable(f"the check's Triton server did not start here ({str(err).splitlines()[0]}); "
                            "your watchdog was not run") from None
    stop = threading.Event()
    loop = _StudentLoop(fn, WatchedServer(rig), stop)
    try:
        # 1. A ready server: leave it alone.
        if loop.wait(lambda: bool(rig.calls), _HEALTHY_S):
            raise Wrong(f"it restarted a healthy server (it answered 200 on /v2/health/ready) after "
                        f"{rig.calls[0][0] - loop.started:.1f} s: does your poll count HTTP 200 from "
                        "f'{server.http_url}/v2/health/ready' as ready? (/api/health/ready is Triton's old v1 "
                        "path: it answers 404)")
        # 2. Killed, as a crash would: restarted once, ready again, and then left alone.
        t_kill = time.monotonic()
        rig.signal(signal.SIGKILL)
        if not loop.wait(lambda: bool(rig.calls), _RESTART_WITHIN_S):
            raise Wrong(f"the server was killed and {_CALL} did not restart it within {_RESTART_WITHIN_S:g} s"
                        f"{loop.at()}: after `failures` failed polls in a row, call server.restart()")
        if not loop.wait(lambda: not rig.busy() and any(ok for _, ok in rig.calls) and rig.server.ready(),
                         _READY_WITHIN_S):
            raise Wrong(f"the server was not ready again within {_READY_WITHIN_S:g} s of the kill: every restart "
                        "failed")
        recovery_s = time.monotonic() - t_kill
        n = len(rig.calls)
        if loop.wait(lambda: len(rig.calls) > n, _QUIET_S):
            raise Wrong(f"the server was ready again {recovery_s:.1f} s after the kill, and {_CALL} restarted it "
                        f"again: {len(rig.calls)} restarts for one crash (a restart storm). Once a poll answers 200, "
                        "start counting failed polls from zero again")
        # 3. Hung: the process still holds the port and accepts connections, but never answers. From now on a
        # restart stops what is left of it and fails, as a start whose port is still taken would.
        n, t_hang = len(rig.calls), time.monotonic()
        rig.failing = True
        rig.signal(signal.SIGSTOP)
        if not loop.wait(lambda: len(rig.calls) > n, _HUNG_WITHIN_S):
            raise Wrong(f"the server hung (its process holds the port and accepts connections, but never answers) "
                        f"and {_CALL} did not restart it within {_HUNG_WITHIN_S:g} s{loop.at()}: give every request "
                        "a timeout, urlopen(url, timeout=timeout_s); without one a poll of a hung server waits "
                        "forever")
        t_first = rig.calls[n][0]
        hang_s = t_first - t_hang
        # 4. Every restart fails: try again, ever more slowly. The tries are counted for _STORM_S from the first.
        loop.wait(lambda: time.monotonic() - t_first >= _STORM_S, _STORM_S + 1)
        tries = sum(1 for t, _ in rig.calls[n:] if t - t_first <= _STORM_S)
        if tries > _STORM_MAX:
            gap = _STORM_S / (tries - 1)
            raise Wrong(f"a restart storm: while every restart failed, it tried {tries} times in {_STORM_S:g} s (one "
                        f"every {gap:.2f} s on average). After a failed restart wait backoff_s, double the wait after "
                        "each failure (at most max_backoff_s), and reset it once the server is ready again")
        # 5. Stop: the function returns promptly.
        loop.end(_STOP_WITHIN_S)
        if loop.thread.is_alive() or isinstance(loop.error, StudentTimeout):
            raise Wrong(f"{_CALL} did not return within {_STOP_WITHIN_S:g} s after `stop` was set{loop.at()}: check "
                        "`stop` between polls, and wait with stop.wait(seconds), which returns as soon as stop is set "
                        "(time.sleep does not)")
        if loop.error is not None:
            raise loop.ended() or Wrong(raised_message(_CALL, loop.error))
        return (f"Against a real Triton: killed, it was restarted once and ready again {recovery_s:.1f} s later; "
                f"hung, it was restarted after {hang_s:.1f} s; with every restart failing from then on, {tries} "
                f"tries in {_STORM_S:g} s (backing off).")
    finally:
        stop.set()
        rig.close()
        loop.end(2.0)


q5 = CodeExercise(
    name="05.5 a watchdog, tested against a real Triton", var="watchdog", grade=_grade_watchdog,
    references=References("write the poll, restart and back-off loop yourself", "lab_utils.monitoring.drills.Watchdog"),
    signature="watchdog(server, stop, poll_s, timeout_s, failures, backoff_s, max_backoff_s) -> None",
    applicable=_server_unavailable,
    hints=[
        "One loop until stop.is_set(): GET f'{server.http_url}/v2/health/ready' with urlopen(url, "
        "timeout=timeout_s); HTTP 200 is ready, anything else (an HTTPError, a refused connection, a timeout: all "
        "OSError) is a failed poll. Count failed polls in a row.",
        "After `failures` failed polls in a row: server.restart() inside try/except (a restart can fail), then wait "
        "`delay` and double it (at most max_backoff_s); when a poll is ready again, reset the count and the delay "
        "to backoff_s.",
        "Wait with stop.wait(seconds), not time.sleep: it returns as soon as stop is set, so the watchdog stops "
        "promptly.",
    ],
    solution_text=(
        "import urllib.request\n\n"
        "def watchdog(server, stop, poll_s=0.5, timeout_s=2.0, failures=3, backoff_s=1.0, max_backoff_s=30.0):\n"
        "    bad, delay = 0, backoff_s\n"
        "    while not stop.is_set():\n"
        "        try:\n"
        "            with urllib.request.urlopen(f\"{server.http_url}/v2/health/ready\", timeout=timeout_s) as r:\n"
        "                ready = r.status == 200\n"
        "        except OSError:  # refused, reset, timed out, or HTTP 4xx/5xx (HTTPError is an OSError too)\n"
        "            ready = False\n"
        "        bad, delay = (0, backoff_s) if ready else (bad + 1, delay)\n"
        "        if bad < failures:\n"
        "            stop.wait(poll_s)\n"
        "            continue\n"
        "        try:\n"
        "            server.restart()\n"
        "        except Exception:\n"
        "            pass  # the start failed: the backoff below grows, and the next failed polls try again\n"
        "        bad = 0\n"
        "        stop.wait(delay)\n"
        "        delay = min(2 * delay, max_backoff_s)"
    ),
)
