"""The real Triton server's lifecycle: found, started on free ports, serving, stopped with its stubs, nothing left
behind (also when the kernel that started it is killed), invalid configurations refused before any start."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from _triton import require_server, tiny_repo

from lab_utils import owned, procs
from lab_utils.exercises.outcomes import NotNow
from lab_utils.serving import client as triton_client
from lab_utils.serving import repository as triton_repo
from lab_utils.serving import server as triton_server
from lab_utils.serving.server import ServerNotFound, ServerStartError, TritonServer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    require_server()
    return tiny_repo(tmp_path_factory.mktemp("triton"))


def _stubs_of(pid: int) -> list[int]:
    return [p for p in procs.group_members(pid) if p != pid]


def _gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not [p for p in pids if _alive(p)]:
            return True
        time.sleep(0.1)
    return False


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_import_starts_nothing():
    code = ("import lab_utils.serving.server, lab_utils.serving.load, lab_utils.serving.repository, "
            "lab_utils.serving.client, lab_utils.serving.capacity, lab_utils.serving.perf_analyzer")
    out = subprocess.run([sys.executable, "-c", code + "; import sys; print('tritonclient' in sys.modules)"],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def test_find_server_order(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_URL", "http://example:8000")
    assert triton_server.find_server().kind == "url"
    fake = tmp_path / "tritonserver"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    src = triton_server.find_server(local=True)  # a URL cannot be started: the binary on the PATH comes next
    assert src.kind == "path" and src.location == str(fake)
    monkeypatch.delenv("TRITON_URL")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(triton_server, "pytriton_server", lambda: Path("/wheel/bin/tritonserver"))
    assert triton_server.find_server().kind == "wheel"
    monkeypatch.setattr(triton_server, "pytriton_server", lambda: None)
    with pytest.raises(ServerNotFound) as err:
        triton_server.find_server()
    text = str(err.value)
    assert "TRITON_URL" in text and "nvcr.io/nvidia/tritonserver" in text and "nvidia-pytriton" in text


def test_start_infer_stop_leaves_nothing(repo):
    server = TritonServer(repo, load_models=(), model_control="none")
    with server:
        assert server.alive() and server.ready() and server.startup_s < 60
        ports = (server.http_port, server.grpc_port, server.metrics_port)
        assert len(set(ports)) == 3
        x = np.random.rand(2, 4).astype(np.float32)
        for proto, url in (("grpc", server.grpc_url), ("http", server.http_url)):
            y = triton_client.infer(url, "tiny", {"INPUT__0": x}, protocol=proto)["OUTPUT__0"]
            np.testing.assert_allclose(y, triton_repo.reference_mlp(repo / "tiny" / "1", x), rtol=1e-5, atol=1e-5)
        stubs = _stubs_of(server.pid)
        assert stubs, "the python backend's stub should run in the server's process group"
        pid = server.pid
        assert server in triton_server.running_servers()
        with open(server.log_path) as f:
            assert "successfully loaded 'tiny'" in f.read()
    assert server.stop() == server.exit_code  # twice is fine
    assert not server.alive() and server not in triton_server.running_servers()
    assert _gone([pid, *stubs], 2.0)
    assert not any(_port_open(p) for p in ports)
    assert server.log_path.exists() and server.log_tail(5)  # the log stays readable after the stop


def test_invalid_config_refused_before_start(repo, tmp_path, monkeypatch):
    bad = tmp_path / "bad"
    shutil.copytree(repo, bad)
    cfg = bad / "tiny" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace("max_batch_size", "max_batch"))
    started = []
    monkeypatch.setattr(owned, "popen_owned", lambda *a, **k: started.append(a))
    with pytest.raises(triton_repo.ConfigError) as err:
        TritonServer(bad).start()
    assert "max_batch" in str(err.value) and "config.pbtxt" in str(err.value)
    cfg.write_text(triton_repo.config_text(triton_repo.mlp_config("tiny", in_features=4, out_features=3,
                                                                  max_batch_size=8,
                                                                  dynamic_batching={"preferred_batch_size": [16]})))
    with pytest.raises(triton_repo.ConfigError) as err:
        TritonServer(bad).start()
    assert "dynamic_batching.preferred_batch_size[0]" in str(err.value)
    assert not started


def test_missing_model_file_named_before_start_and_by_the_server(repo, tmp_path):
    # other servers of this worker (a session's service) may be running: only this test's must be gone
    before = set(map(id, triton_server.running_servers()))
    bad = tmp_path / "nofile"
    shutil.copytree(repo, bad)
    (bad / "tiny" / "1" / "model.py").unlink()
    with pytest.raises(triton_repo.ConfigError, match=r"model\.py is missing"):
        TritonServer(bad).start()
    # skipping our validation, the server itself refuses; the error carries its log tail and the model
    with pytest.raises(ServerStartError) as err:
        TritonServer(bad, validate=False).start()
    # (Triton 2.51 hangs when a python model's file is missing: the log line ends the wait at once)
    assert "model.py" in str(err.value) and err.value.log_tail
    assert any("not found" in why for why in err.value.failed_models.values())
    assert not [s for s in triton_server.running_servers() if id(s) not in before]


def test_busy_port_is_avoided(repo, monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(ServerStartError, match=f"http_port={port} is already in use"):
            TritonServer(repo, http_port=port).start()
        handed = iter([port])
        real = owned.free_port
        monkeypatch.setattr(owned, "free_port", lambda host="127.0.0.1": next(handed, None) or real(host))
        # a port taken between choosing and binding: the server fails to bind, and is started again elsewhere
        monkeypatch.setattr(owned, "port_free", lambda p, host="127.0.0.1": True)
        with TritonServer(repo) as server:
            assert port not in (server.http_port, server.grpc_port, server.metrics_port)
            assert server.ready()


def test_killed_server_reported_and_restarted(repo):
    with TritonServer(repo) as server:
        old = server.pid
        stubs = _stubs_of(old)
        assert server.exit_status() == "running"
        os.kill(old, signal.SIGKILL)
        # what lab 04's "server dies" cell relies on: wait for the exit, then report it truthfully
        assert server.wait_exit(timeout_s=10) == -signal.SIGKILL
        assert not server.alive() and not server.ready()
        assert server.exit_status() == "killed by SIGKILL (signal 9)"
        assert "successfully loaded" in server.log_tail(200)
        assert _gone(stubs, 10.0), "the stubs notice their server is gone"
        server.restart()
        assert server.alive() and server.pid != old and server.ready()
    assert not server.alive()


def test_a_killed_owners_stubs_end_even_when_they_cannot_notice(repo):
    """The owner (a kernel) is SIGKILLed: its server dies by its parent-death signal, and the python-backend stubs
    by the server's group watchdog even where they cannot notice (here stopped with SIGSTOP; on a GPU one caught
    SIGTERM, outlived its server and kept 742 MiB of GPU memory)."""
    code = ("import sys\nfrom lab_utils import procs\nfrom lab_utils.serving.server import TritonServer\n"
            f"s = TritonServer({str(repo)!r}).start()\n"
            "print(s.pid, *[p for p in procs.group_members(s.pid) if p != s.pid], flush=True)\nsys.stdin.read()\n")
    owner = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd=ROOT)
    pids: list[int] = []
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) >= 2, "the tiny repository's python model runs in a stub"
        for stub in pids[1:]:
            os.kill(stub, signal.SIGSTOP)  # now it notices nothing: only SIGKILL ends it
        owner.kill()
        owner.wait()
        assert _gone(pids, 15.0), f"still running after their owner was killed: {[p for p in pids if _alive(p)]}"
    finally:
        owner.kill()
        owner.wait()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        procs.sweep_stale_tempdirs()  # what `nvlab doctor` removes: the killed owner's folders and shared memory
        triton_server.remove_stale_shm()


def test_a_crashed_server_is_named_and_lab04_restarts_it_before_a_check(repo):
    """Triton's SIGSEGV handler logs the signal, then leaves the process alive and deaf (seen in CI: every later
    load_model hung) or lets it exit: crashed() reads the log either way; lab 04's checks restart a deaf server first
    and tell the student to restart an exited one."""
    from lab_utils.exercises import lab04
    from lab_utils.exercises.lab04 import server as lab04_server  # where the bound server lives

    with TritonServer(repo) as server:
        assert server.crashed() is None
        old = server.pid
        os.kill(old, signal.SIGSEGV)
        deadline = time.monotonic() + 10
        while server.crashed() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.crashed() == "tritonserver logged signal 11 and stopped answering"
        # the handler logs the signal, then either leaves the process alive and deaf or lets it exit (CI saw both,
        # the exit within 0.1 s of the log line)
        exited = procs.wait_until(lambda: not server.alive(), 2.0)
        lab04.use_server(server, repo)
        try:
            if exited:  # what every code check of lab 04 calls first says so, and what the student runs
                with pytest.raises(NotNow, match=r"killed by SIGSEGV \(signal 11\).*server\.restart\(\)"):
                    lab04_server._lab()
                server.restart()
            else:  # alive and deaf: a student cannot tell, so the check restarts it
                lab04_server._lab()
        finally:
            lab04_server._BOUND.clear()
        assert server.crashed() is None and server.pid != old and server.ready()
        mid = server.pid
        os.kill(mid, signal.SIGSEGV)
        deadline = time.monotonic() + 10
        while server.crashed() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.start() is server and server.pid != mid and server.ready()  # a start replaces a crashed one


def test_quick_stop_shortens_a_stop(repo, quick_stop):
    """tests/conftest.py's grace reaches every test server (before, the fixture patched a module constant the class
    had already read, and did nothing): a server that cannot act on SIGTERM (SIGSTOPped) is SIGKILLed after
    ``quick_stop`` seconds, not after the library's 1 s."""
    server = TritonServer(repo)
    assert server.stop_grace_s == quick_stop < triton_server.DEFAULT_STOP_GRACE_S
    with server:
        os.kill(server.pid, signal.SIGSTOP)
        t0 = time.perf_counter()
        server.stop()
        took = time.perf_counter() - t0
    assert server.exit_code == -signal.SIGKILL and quick_stop <= took < triton_server.DEFAULT_STOP_GRACE_S, took


def test_startup_failure_shows_log_tail(repo):
    with pytest.raises(ServerStartError) as err:
        TritonServer(repo, extra_args=("--no-such-flag=1",)).start()
    assert "exited with code" in str(err.value) and "no-such-flag" in str(err.value) and err.value.log_tail


def test_external_server_from_triton_url(shared_triton, monkeypatch):
    server = shared_triton.server
    monkeypatch.setenv("TRITON_URL", server.http_url)
    monkeypatch.setenv("TRITON_GRPC_URL", server.grpc_url)
    ext = triton_server.connect_or_start(shared_triton.repo)
    assert ext.external and ext.http_url == server.http_url and ext.grpc_url == server.grpc_url
    assert ext.alive() and "external" in ext.log_tail()
    ext.stop()
    assert server.alive()  # stopping an external server does nothing
    x = np.ones((1, 4), np.float32)
    assert triton_client.infer(ext.grpc_url, "tiny", {"INPUT__0": x})["OUTPUT__0"].shape == (1, 3)


def test_bad_arguments():
    with pytest.raises(ValueError, match="model_control"):
        TritonServer(".", model_control="auto")
    with pytest.raises(ValueError, match="load_models"):
        TritonServer(".", load_models=("x",))
    with pytest.raises(ServerStartError, match="not a folder"):
        TritonServer("/nonexistent/repo").start()


def test_empty_repository_is_warned_about_before_the_start(tmp_path):
    empty = tmp_path / "models"
    (empty / ".ipynb_checkpoints").mkdir(parents=True)  # hidden folders and loose files are no models
    (empty / "README.md").write_text("models go here\n")
    never = triton_server.ServerSource("url", "http://127.0.0.1:1")  # refused after the check: nothing starts
    for mode, then in (("none", "serve no model"), ("explicit", "load_model")):
        with pytest.warns(triton_server.EmptyRepositoryWarning, match=rf"{empty} has no model folders.*{then}"), \
                pytest.raises(ServerStartError, match="ExternalServer"):
            TritonServer(empty, model_control=mode, source=never).start()
    (empty / "m").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error", triton_server.EmptyRepositoryWarning)
        with pytest.raises(Exception, match="config.pbtxt"):  # a model folder: no warning, validated instead
            TritonServer(empty, source=never).start()


# A kernel killed mid-lab leaves no server, stub or shared memory: test_service.py's killed-kernel test proves it
# for lab 07's and lab 08's servers (Triton with its stubs among them) in one kernel.


def test_describe_exit():
    assert triton_server.describe_exit(0) == "exit code 0"
    assert triton_server.describe_exit(-signal.SIGTERM) == "killed by SIGTERM (signal 15)"


def test_port_in_time_wait_counts_as_free_a_listener_does_not():
    """The probe binds with SO_REUSEADDR as Triton does: a killed server's ports (TIME_WAIT) can be taken again."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Triton's listeners (Linux: both sides)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        assert not procs.port_free(port)
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = listener.accept()
        conn.close()  # the server side closes first: its end of the connection goes to TIME_WAIT on `port`
        time.sleep(0.05)
        client.close()
    time.sleep(0.05)
    with socket.socket() as plain:  # without SO_REUSEADDR the port looks busy
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
    assert procs.port_free(port)


def test_killed_server_restarts_on_its_fixed_ports(repo):
    ports = {k: procs.free_port() for k in ("http_port", "grpc_port", "metrics_port")}
    with TritonServer(repo, **ports) as server:
        assert server.ready()
        held = socket.create_connection(("127.0.0.1", ports["http_port"]))  # a client's open connection
        os.kill(server.pid, signal.SIGKILL)
        server.wait_exit(timeout_s=10)
        held.close()
        server.restart()
        assert (server.http_port, server.grpc_port, server.metrics_port) == tuple(ports.values())
        assert server.ready()


def test_lab05_model_answers_right_through_the_server(shared_triton):
    """Lab 05 deploys lab 04's model (DLPack across the python backend): the numbers, not only a count."""
    from lab_utils.monitoring import drills

    repo, server = shared_triton.repo, shared_triton.server  # drills.write_model's repository
    assert (repo / drills.MODEL_NAME / "1" / "model.py").read_text() == triton_model_source()
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    y = triton_client.infer(server.grpc_url, drills.MODEL_NAME, {"INPUT__0": x})["OUTPUT__0"]
    one = drills.make_inputs()()
    y1 = triton_client.infer(server.http_url, drills.MODEL_NAME, one, protocol="http")["OUTPUT__0"]
    want = drills.reference_output(repo, x)
    assert y.shape == (3, 16) and np.abs(want).max() > 0
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(y1, drills.reference_output(repo, one["INPUT__0"]), rtol=1e-4, atol=1e-5)


def triton_model_source() -> str:
    from lab_utils.serving.backend import model as triton_model

    return triton_model.source()


def test_http_tensors_are_binary_by_default_and_json_costs_measured(shared_triton):
    """tritonclient.http defaults to binary tensors (inputs and requested outputs); binary_data=False sends JSON
    numbers. Both measured on the real server: JSON's request body is larger, the answers are the same."""
    import inspect

    import tritonclient.http as httpclient

    assert inspect.signature(httpclient.InferInput.set_data_from_numpy).parameters["binary_data"].default is True
    assert inspect.signature(httpclient.InferRequestedOutput).parameters["binary_data"].default is True
    x = np.random.default_rng(0).standard_normal((8, 4), dtype=np.float32)
    rows = triton_client.http_encoding_cost(shared_triton.http_url, "tiny", {"INPUT__0": x}, ["OUTPUT__0"], reps=3,
                                            warmup=1)
    json_row, bin_row = rows
    assert (json_row["encoding"], json_row["binary_data"], bin_row["encoding"], bin_row["binary_data"]) == \
        ("JSON", False, "binary", True)
    assert json_row["request_bytes"] > bin_row["request_bytes"] > x.nbytes  # header + raw bytes, against text
    assert json_row["response_bytes"] > 0 and bin_row["response_bytes"] > 0
    assert bin_row["max_abs_diff"] < 1e-5 and all(r["median_ms"] > 0 for r in rows)


# the line CI saw once, as tritonserver logged it before it exited with -6 at start (not built from the constant, so
# a constant that drifted from the real message fails here)
ABORT_LOG = ("E1205 03:06:45.964346   20052 ev_epoll1_linux.cc:373] (event_engine) Epoll1Poller:0x7f1fcc007320 "
             "encountered epoll_wait error: Bad file descriptor\n")


@pytest.mark.parametrize(("code", "log", "transient"), [(-signal.SIGABRT, ABORT_LOG, True),
                                                        (-signal.SIGSEGV, ABORT_LOG, False),
                                                        (-signal.SIGABRT, "E model 'x' failed to load\n", False),
                                                        (1, ABORT_LOG, False)])
def test_only_grpcs_abort_at_start_is_called_transient(tmp_path, code, log, transient):
    err = TritonServer(tmp_path)._failure(False, code, log)
    assert isinstance(err, ServerStartError) and err.nvlab_transient is transient


@pytest.mark.parametrize("transient", [True, False])
def test_a_transient_start_failure_is_tried_once_more_any_other_raised_at_once(tmp_path, monkeypatch, transient):
    require_server()
    real, calls = TritonServer._start_once, []

    def first_start_fails(self):
        calls.append(1)
        if len(calls) == 1:
            err = ServerStartError("tritonserver exited with code -6 before it was ready.")
            err.nvlab_transient = transient
            raise err
        return real(self)

    monkeypatch.setattr(TritonServer, "_start_once", first_start_fails)
    server = TritonServer(tiny_repo(tmp_path))
    if not transient:
        with pytest.raises(ServerStartError, match="code -6"):
            server.start()
        assert len(calls) == 1 and not server.alive()
        return
    with server:
        # the transient failure was tried once more; a third start follows only when the second lost its ports to
        # another process meanwhile (seen once in CI: the port retry, a separate rule)
        assert server.ready() and len(calls) in (2, 3), calls


# Forks beside gRPC callers, in a fresh interpreter that imports lab_utils first (argv: the server's gRPC address).
_FORKS_BESIDE_GRPC = """
import subprocess, sys, threading, time
import lab_utils
import numpy as np
import tritonclient.grpc as g
from lab_utils.procs import popen_owned

stop, failed = threading.Event(), []

def call():
    c = g.InferenceServerClient(sys.argv[1])
    meta = c.get_model_metadata("tiny").inputs[0]
    dims = [1, *(int(d) for d in meta.shape[1:])]
    x = g.InferInput(meta.name, dims, "FP32")
    x.set_data_from_numpy(np.zeros(dims, np.float32))
    while not stop.is_set():
        try:
            c.infer("tiny", [x])
        except Exception as err:
            failed.append(repr(err)[:200])

threads = [threading.Thread(target=call, daemon=True) for _ in range(3)]
for t in threads:
    t.start()
codes, t0 = [], time.monotonic()
while time.monotonic() - t0 < 6:
    codes.append(popen_owned(["true"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).wait())
stop.set()
print(len(codes), [c for c in codes if c], failed[:3])
"""


def test_servers_forked_beside_grpc_calls_start_and_cut_no_stream(shared_triton):
    """A course process forks its servers (``procs.popen_owned``) while other threads make gRPC calls, with gRPC's
    fork support on (its default). When Python ran between the fork and the exec (``preexec_fn``), 8 of 477
    children died before their exec (SIGABRT, SIGSEGV) and a caller's stream was cut ("Socket closed")."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    out = subprocess.run([sys.executable, "-c", _FORKS_BESIDE_GRPC, shared_triton.grpc_url], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    assert int(last.split()[0]) >= 50 and last.endswith(" [] []"), (last, out.stderr[-1500:])
