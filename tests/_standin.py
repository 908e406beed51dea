"""A stand-in for the Triton server that lab 05's watchdog check kills: a small HTTP process answering Triton's
health paths, started in a tenth of a second instead of Triton's seconds. The wrong watchdogs are graded against
it; one right watchdog still meets the real server (tests/test_exercises_lab05.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

from lab_utils.procs import free_port

_SERVE = """
import http.server, sys

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path in ("/v2/health/ready", "/v2/health/live")
        self.send_response(200 if ok else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


class StandInServer:
    """``start/stop/restart/alive/ready/pid`` as ``TritonServer`` has them, on one HTTP port kept by every restart
    (picked free here)."""

    def __init__(self, http_port: int | None = None):
        http_port = http_port or free_port()
        self.http_url = f"http://127.0.0.1:{http_port}"
        self._port = http_port
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def start(self) -> StandInServer:
        if self.alive():
            return self
        self._proc = subprocess.Popen([sys.executable, "-c", _SERVE, str(self._port)], start_new_session=True,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while not self.ready():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the stand-in server did not answer on {self.http_url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """SIGKILL to its group (a stopped, "hung" process is ended too); safe to call twice."""
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._proc is not None:
            self._proc.wait(10)

    def restart(self) -> StandInServer:
        self.stop()
        self._proc = None
        return self.start()
