"""A server's ports and process group are its own, under xdist beside other workers' servers.

A port is picked free (bound to port 0, closed) and bound by the server a moment later; in between another
program's own pick can land on it (under xdist: another worker's Prometheus exporter). The server then fails its
bind and exits, and its readiness probe may be answered by that program (an exporter answers 200 to any GET): the
start must notice and try new ports, never return a server that is gone. And a
stopped server's pid, the id of its process group, may belong to a new process by the time its owner stops it
again (pid_max is 32768 on many machines): that other group must live on."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import urllib.request

import pytest

from lab_utils.procs import GroupWatchdog, free_port, group_listen_ports, pid_alive, stop_group
from lab_utils.serving import nginx as ng
from lab_utils.serving.nginx import NginxServer


class Squatter(http.server.ThreadingHTTPServer):
    """What prometheus_client's exporter does: 200 to any GET, 405 to anything else."""

    def __init__(self):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"# an exporter's metrics\n")

            def do_POST(self):  # noqa: N802
                self.send_error(405, "use OPTIONS or GET")

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.port = self.server_address[1]
        self.thread = threading.Thread(target=self.serve_forever, name="squatter", daemon=True)
        self.thread.start()

    def close(self):
        self.shutdown()
        self.server_close()


@pytest.fixture
def squatter():
    s = Squatter()
    yield s
    s.close()


def _nginx_here():
    why = ng.missing()
    if why:
        if ng.required():
            pytest.fail(f"{ng.REQUIRE_ENV}=1 but {why}")
        pytest.skip(f"no nginx here: {why}")


def test_a_port_taken_between_pick_and_bind_gets_new_ports(squatter):
    """nginx's status port (its readiness probe's) is handed the squatter's port: the start must come back with
    nginx alive on ports of its own (before: it returned "ready" on the squatter's answer, nginx already gone)."""
    _nginx_here()
    server = NginxServer(["127.0.0.1:9"], stop_grace_s=0.3)
    names = list(server._ports_fixed)
    picks: list[int] = []

    def pick() -> int:  # the status port's first pick lands on the squatter's port, as a race would have it
        picks.append(squatter.port if len(picks) == names.index("status_port") else free_port())
        return picks[-1]

    server._free_port = pick
    with server:
        assert server.alive(), server.log_tail(10)
        assert squatter.port in picks and squatter.port not in (server.http_port, server.status_port)
        assert {server.http_port, server.status_port} <= group_listen_ports(server.pid)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.status_port}/generation", timeout=5) as r:
            assert r.read().strip() == b"0"  # nginx's own answer, not the squatter's


def test_the_error_says_which_port_was_taken_and_by_whom():
    """Three starts in a row that each lose their status port (three squatters): the error names the port."""
    _nginx_here()
    squatters = [Squatter() for _ in range(3)]
    try:
        server = NginxServer(["127.0.0.1:9"], stop_grace_s=0.3)
        names = list(server._ports_fixed)
        count = [0]

        def pick() -> int:
            n = count[0]
            count[0] += 1
            if n % len(names) == names.index("status_port"):
                return squatters[min(n // len(names), 2)].port
            return free_port()

        server._free_port = pick
        with pytest.raises(ng.NginxStartError) as err:
            server.start()
        assert not server.alive()
        text = str(err.value)
        assert str(squatters[2].port) in text and "already in use" in text.lower(), text
    finally:
        for s in squatters:
            s.close()


def _triton_losing_its_first_http_port(squatter, tmp_path, **kw):
    """A Triton server whose first pick of an HTTP port is the squatter's (as a race would have it), and its picks."""
    from _triton import require_server, tiny_repo

    from lab_utils.serving.server import TritonServer

    require_server()
    server = TritonServer(tiny_repo(tmp_path), stop_grace_s=0.3, **kw)
    first_http = list(server._ports_fixed).index("http_port")
    picks: list[int] = []

    def pick() -> int:
        picks.append(squatter.port if len(picks) == first_http else free_port())
        return picks[-1]

    server._free_port = pick
    return server, picks


def test_a_triton_whose_http_port_is_taken_while_it_loads_gets_new_ports(squatter, tmp_path):
    """CI's case: Triton binds its ports only after loading its models (seconds); an exporter that took its HTTP port
    meanwhile answered the readiness probe, and lab 07's nginx then sent inference to the exporter (405)."""
    server, picks = _triton_losing_its_first_http_port(squatter, tmp_path)
    with server:
        assert squatter.port in picks and server.http_port != squatter.port
        assert server.alive() and server.ready() and server.http_port in group_listen_ports(server.pid)


def test_a_server_that_keeps_its_ports_moves_them_only_at_its_first_start(squatter, tmp_path):
    """``keep_ports`` (lab 05's watchdog check: a restart keeps the address): an HTTP port taken during the first
    start gets new ports, as any server's (a CI run graded the watchdog not applicable when its ports were fixed from
    the outset); once started, a restart asks for the same ports again."""
    server, picks = _triton_losing_its_first_http_port(squatter, tmp_path, keep_ports=True)
    with server:
        assert squatter.port in picks and server.http_port != squatter.port
        ports = [server.http_port, server.grpc_port, server.metrics_port]
        server.restart()
        assert [server.http_port, server.grpc_port, server.metrics_port] == ports and server.ready()
        assert server.http_port in group_listen_ports(server.pid)


def test_stopping_an_exited_server_spares_the_group_that_took_its_pid():
    """The leader exited and was reaped; its pid now leads another program's group (here a stand-in: the pid the
    system would hand out again is out of a test's control). Stopping the old one again must not kill that group
    (before: SIGKILL to it, as group_members found it under the old number)."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    old = subprocess.Popen(sleeper, start_new_session=True)
    other = subprocess.Popen(sleeper, start_new_session=True)
    try:
        old.kill()
        old.wait()
        old.pid = other.pid  # what a reuse of the number looks like from the old Popen's side
        stop_group(old, grace_s=0.1, kill_wait_s=0.5)
        assert pid_alive(other.pid) and other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_a_watchdog_whose_owner_died_ends_its_group_but_not_one_that_took_the_leaders_pid(tmp_path):
    """The watchdog ends the group of an owner killed outright; when the leader ended earlier and its pid went to
    another program's session leader, that group lives on (before: the watchdog killed whatever had the number)."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    ours = subprocess.Popen(sleeper, start_new_session=True)
    other = subprocess.Popen(sleeper, start_new_session=True)
    try:
        for target, armed_as in ((ours, None), (other, "1")):  # other: armed for a leader started at tick 1
            folder = tmp_path / f"owned-{target.pid}"
            folder.mkdir()
            dog = GroupWatchdog(folder, term_s=0.5, kill_s=1.0)
            if armed_as is None:
                dog.arm(target.pid)
            else:  # what arm() wrote for the earlier leader whose number `other` has now
                dog._pipe.write(f"{target.pid}\n{armed_as}\n")
                dog._pipe.flush()
            dog._pipe.close()  # the owner is gone: end of file without "stopped"
            dog.proc.wait(timeout=20)
            assert not folder.exists()  # the owner's folder goes either way
        assert ours.wait(timeout=10) is not None
        assert other.poll() is None and pid_alive(other.pid)
    finally:
        for p in (ours, other):
            p.kill()
            p.wait()


_READ_PDEATHSIG = """
import ctypes
sig = ctypes.c_int()
ctypes.CDLL("libc.so.6", use_errno=True).prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
print(sig.value)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_an_owned_childs_parent_death_signal_is_sigkill_and_a_missing_program_is_named(tmp_path):
    """``popen_owned`` sets the child's parent-death signal (SIGKILL) before the exec (the killed-owner tests show it
    fire), and a program that is not there raises FileNotFoundError naming it, as ``Popen`` does (not a wrapper's
    exit code 127)."""
    from lab_utils.procs import popen_owned

    child = popen_owned([sys.executable, "-c", _READ_PDEATHSIG], stdout=subprocess.PIPE, text=True)
    out, _ = child.communicate(timeout=60)
    assert (child.returncode, out.strip()) == (0, "9")
    (tmp_path / "plain.txt").write_text("not a program")
    for argv, kw in [(["nvlab-no-such-program"], {}), (["./plain.txt"], {"cwd": tmp_path}),
                     (["python3"], {"env": {"PATH": str(tmp_path)}})]:
        with pytest.raises(FileNotFoundError, match=argv[0].lstrip("./")):
            popen_owned(argv, **kw)
