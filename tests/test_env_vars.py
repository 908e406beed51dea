"""Bad input from the environment fails safely: every variable the course reads is checked where it is read and a
bad value is named with the form expected; a URL where nothing listens, or where something other than Triton or
Prometheus answers, is told apart within seconds. No server binary is needed: a tiny HTTP server plays the part."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lab_utils import procs
from lab_utils.course import probe as course_probe
from lab_utils.course import session
from lab_utils.monitoring import prometheus
from lab_utils.procs import EnvError, check_service, env_flag, env_int, env_url, free_port, http_ok
from lab_utils.serving import server as triton_server
from lab_utils.serving.server import ExternalServer, ServerStartError

TRITON_META = {"name": "triton", "version": "2.51.0", "extensions": ["classification", "model_repository"]}
PROM_BUILDINFO = {"status": "success", "data": {"version": "2.45.3", "goVersion": "go1.22"}}


class _Fake:
    """An HTTP server on a free port answering ``routes`` ({path: (status, body)}); anything else is a 404."""

    def __init__(self, routes: dict[str, tuple[int, bytes]]):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                fake.hits.append(self.path)
                status, body = routes.get(self.path, (404, b"<html>Not Found</html>"))
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # quiet: pytest shows stderr of failures only
                pass

        self.hits: list[str] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def fake_http() -> Iterator:
    made: list[_Fake] = []

    def make(routes: dict[str, tuple[int, bytes]] | None = None) -> _Fake:
        made.append(_Fake(routes or {"/": (200, b"<html>hello</html>")}))
        return made[-1]

    yield make
    for f in made:
        f.close()


@pytest.fixture
def not_http() -> Iterator[str]:
    """A TCP server that answers every connection with a line that is not HTTP."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
                time.sleep(0.05)

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    th.join(timeout=5)
    srv.close()


# --- the parsers ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw, want", [("1", True), ("TRUE", True), (" yes ", True), ("0", False),
                                       ("false", False), ("No", False), ("", False)])
def test_env_flag_reads_the_six_words(monkeypatch, raw, want):
    monkeypatch.setenv("NVLAB_TEST_FLAG", raw)
    assert env_flag("NVLAB_TEST_FLAG") is want


def test_env_flag_refuses_anything_else_naming_the_variable_and_the_words(monkeypatch):
    monkeypatch.setenv("NVLAB_QUICK", "maybe")
    for read in (lambda: env_flag("NVLAB_QUICK"), session.quick_mode):
        with pytest.raises(EnvError) as err:
            read()
        assert "NVLAB_QUICK='maybe'" in str(err.value) and "1/true/yes/0/false/no" in str(err.value)
    monkeypatch.setenv(prometheus.REQUIRE_ENV, "on")
    with pytest.raises(ValueError, match="NVLAB_REQUIRE_PROMETHEUS='on'.*1/true/yes/0/false/no"):
        prometheus.required()
    monkeypatch.setenv(prometheus.REQUIRE_ENV, "0")
    assert prometheus.required() is False  # "0" meant no before too: only "1/true/yes" mean yes
    monkeypatch.delenv("NVLAB_QUICK")
    assert session.quick_mode() is False


def test_env_int(monkeypatch):
    monkeypatch.delenv("NVLAB_TEST_INT", raising=False)
    assert env_int("NVLAB_TEST_INT", 7) == 7
    monkeypatch.setenv("NVLAB_TEST_INT", " 12 ")
    assert env_int("NVLAB_TEST_INT", minimum=1) == 12
    for bad in ("twelve", "1.5", "0"):
        monkeypatch.setenv("NVLAB_TEST_INT", bad)
        with pytest.raises(EnvError, match=f"NVLAB_TEST_INT='{bad}': expected an integer >= 1"):
            env_int("NVLAB_TEST_INT", minimum=1)


@pytest.mark.parametrize("raw, why", [("127.0.0.1:abc", "the port 'abc' is not a number"),
                                      ("http://127.0.0.1:99999", "the port '99999'"),
                                      ("http://:8000", "no host"),
                                      ("ftp://host:8000", "the scheme 'ftp'"),
                                      ("http://host:8000/v2/health", "nothing may follow the port")])
def test_a_bad_triton_url_is_named_with_the_form_expected(monkeypatch, raw, why):
    monkeypatch.setenv("TRITON_URL", raw)
    for read in (triton_server.find_server, ExternalServer.from_env,
                 lambda: triton_server.connect_or_start("/nonexistent")):
        with pytest.raises(EnvError) as err:  # before: urllib's "Invalid URL" ValueError, or a 30 s wait
            read()
        text = str(err.value)
        assert text.startswith(f"TRITON_URL={raw!r}: expected http://HOST:PORT") and why in text


def test_good_urls_are_normalised(monkeypatch):
    monkeypatch.setenv("TRITON_URL", "localhost")
    assert env_url("TRITON_URL", default_port=8000) == "http://localhost:8000"
    monkeypatch.setenv("TRITON_URL", "[::1]:8000/")
    ext = ExternalServer.from_env()
    assert ext.http_url == "http://[::1]:8000" and ext.grpc_url == "[::1]:8001" and ext.host == "::1"
    monkeypatch.setenv("TRITON_URL", "http://triton:8000")
    monkeypatch.setenv("TRITON_GRPC_URL", "grpc://triton:9001")
    assert ExternalServer.from_env().grpc_url == "triton:9001"
    monkeypatch.setenv("TRITON_GRPC_URL", "triton:grpc")
    with pytest.raises(EnvError, match="TRITON_GRPC_URL='triton:grpc': expected HOST:PORT"):
        ExternalServer.from_env()
    monkeypatch.delenv("TRITON_URL")
    assert env_url("TRITON_URL") is None


def test_a_bad_prometheus_url_is_named(monkeypatch):
    monkeypatch.setenv(prometheus.URL_ENV, "http://prometheus:nine")
    with pytest.raises(EnvError, match=r"PROMETHEUS_URL='http://prometheus:nine': expected http://HOST:PORT"):
        prometheus.start_metrics({"x": ["127.0.0.1:1"]}, show=False)


def test_the_environment_report_shows_a_bad_url_instead_of_crashing(monkeypatch):
    monkeypatch.setenv("TRITON_URL", "127.0.0.1:abc")
    monkeypatch.setenv("PROMETHEUS_URL", "prometheus:abc")
    comps = course_probe.probe_components()
    triton = comps["tritonserver"]
    assert not triton.present and "TRITON_URL='127.0.0.1:abc': expected http://HOST:PORT" in triton.note
    assert "PROMETHEUS_URL='prometheus:abc'" in comps["prometheus"].note


# --- one HTTP probe -------------------------------------------------------------------------------------------


def test_http_ok_says_what_happened(fake_http, not_http):
    fake = fake_http({"/ok": (200, b'{"a": 1}'), "/busy": (503, b"Service Unavailable")})
    assert http_ok(f"{fake.url}/ok") == (True, "HTTP 200")
    assert http_ok(f"{fake.url}/busy") == (False, "HTTP 503")
    assert http_ok(f"{fake.url}/nope") == (False, "HTTP 404")
    ok, why = http_ok(f"{fake.url}/ok", check=lambda body: json.loads(body)["a"] == 2)
    assert not ok and why.startswith("HTTP 200, unexpected body b'{\"a\": 1}'")
    assert http_ok(f"{fake.url}/ok", check=lambda body: json.loads(body)["missing"])[0] is False  # raising: no
    assert http_ok(f"http://127.0.0.1:{free_port()}/") == (False, "ConnectionRefusedError")
    assert http_ok(not_http)[0] is False and http_ok(not_http)[1] in ("BadStatusLine", "RemoteDisconnected")
    assert http_ok("http://127.0.0.1:abc/") == (False, "InvalidURL")  # never raised


def test_wait_http_ok_uses_the_probe(fake_http):
    fake = fake_http({"/ready": (200, b"")})
    assert procs.wait_http_ok(f"{fake.url}/ready", None, timeout_s=2)
    with pytest.raises(TimeoutError):
        procs.wait_http_ok(f"{fake.url}/not-ready", None, timeout_s=0.3)


# --- something answers, but it is not Triton; nothing answers ------------------------------------------------


def test_a_web_server_at_triton_url_is_not_taken_for_triton(monkeypatch, fake_http):
    fake = fake_http({"/": (200, b"<html>my app</html>"), "/v2/health/ready": (200, b"OK")})
    monkeypatch.setenv("TRITON_URL", fake.url)
    t0 = time.monotonic()
    with pytest.raises(ServerStartError) as err:
        triton_server.connect_or_start("/nonexistent")
    assert time.monotonic() - t0 < 3  # before: a 30 s wait, then "is it running?"
    host_port = fake.url.removeprefix("http://")
    assert str(err.value) == f"{host_port} answers HTTP but is not Triton: GET /v2 gave HTTP 404 (TRITON_URL)"
    fake2 = fake_http({"/v2": (200, b"<html>a catch-all page</html>")})  # 200 everywhere is not enough
    with pytest.raises(ServerStartError, match=r"answers HTTP but is not Triton: GET /v2 gave HTTP 200, unexpected"):
        ExternalServer(fake2.url).start()


def test_nothing_listening_at_triton_url_is_told_in_seconds(monkeypatch):
    monkeypatch.setattr(triton_server, "IDENTIFY_S", 0.5)
    port = free_port()
    monkeypatch.setenv("TRITON_URL", f"127.0.0.1:{port}")
    t0 = time.monotonic()
    with pytest.raises(ServerStartError) as err:
        triton_server.connect_or_start("/nonexistent")
    assert time.monotonic() - t0 < 3
    assert str(err.value).startswith(f"nothing listens at 127.0.0.1:{port} (TRITON_URL): is the server up")


def test_a_non_http_service_at_triton_url(not_http):
    with pytest.raises(ServerStartError, match=r"answers but does not speak HTTP|nothing answers HTTP"):
        ExternalServer(not_http).start(timeout_s=1)


def test_a_triton_lookalike_is_waited_for_until_ready(fake_http):
    fake = fake_http({"/v2": (200, json.dumps(TRITON_META).encode()), "/v2/health/live": (200, b"")})
    with pytest.raises(ServerStartError, match=r"not ready after 0.5 s \(GET /v2/health/ready: HTTP 404\)"):
        ExternalServer(fake.url).start(timeout_s=0.5)
    ready = fake_http({"/v2": (200, json.dumps(TRITON_META).encode()), "/v2/health/ready": (200, b""),
                       "/v2/health/live": (200, b"")})
    ext = ExternalServer(ready.url).start(timeout_s=2)
    assert ext.alive() and ext.ready()


# --- the same for Prometheus ---------------------------------------------------------------------------------


def test_a_web_server_at_prometheus_url_is_not_taken_for_prometheus(monkeypatch, fake_http):
    fake = fake_http({"/-/ready": (200, b"OK")})  # a ready page alone proves nothing
    monkeypatch.setenv(prometheus.URL_ENV, fake.url)
    t0 = time.monotonic()
    with pytest.raises(prometheus.PrometheusError) as err:
        prometheus.start_metrics({"x": ["127.0.0.1:1"]}, show=False)
    assert time.monotonic() - t0 < 3
    host_port = fake.url.removeprefix("http://")
    assert str(err.value) == (f"{host_port} answers HTTP but is not Prometheus: GET /api/v1/status/buildinfo gave "
                              "HTTP 404 (PROMETHEUS_URL)")


def test_nothing_listening_at_prometheus_url_is_told_in_seconds(monkeypatch):
    monkeypatch.setattr(prometheus, "IDENTIFY_S", 0.5)
    port = free_port()
    monkeypatch.setenv(prometheus.URL_ENV, f"http://127.0.0.1:{port}")
    with pytest.raises(prometheus.PrometheusError, match=rf"nothing listens at 127.0.0.1:{port} \(PROMETHEUS_URL\)"
                                                         r": is the compose stack up"):
        prometheus.start_metrics({"x": ["127.0.0.1:1"]}, show=False)


def test_a_prometheus_lookalike_is_used_when_ready(monkeypatch, fake_http):
    fake = fake_http({"/api/v1/status/buildinfo": (200, json.dumps(PROM_BUILDINFO).encode()),
                      "/-/ready": (503, b"Service Unavailable")})
    monkeypatch.setenv(prometheus.URL_ENV, fake.url)
    with pytest.raises(prometheus.PrometheusError, match=r"is not ready \(GET /-/ready: HTTP 503\)"):
        prometheus.start_metrics({"x": ["127.0.0.1:1"]}, show=False)
    ready = fake_http({"/api/v1/status/buildinfo": (200, json.dumps(PROM_BUILDINFO).encode()),
                       "/-/ready": (200, b"Prometheus Server is Ready.\n")})
    monkeypatch.setenv(prometheus.URL_ENV, ready.url + "/")
    backend = prometheus.start_metrics({"x": ["127.0.0.1:1"]}, show=False)
    assert backend.kind == "external" and backend.url == ready.url and backend.ready()


def test_a_starting_server_answering_503_is_waited_for_then_named():
    fake = _Fake({"/v2": (503, b"Service Unavailable")})
    try:
        t0 = time.monotonic()
        why = check_service(fake.url, "/v2", lambda b: True, "Triton", "TRITON_URL", wait_s=0.6)
        assert time.monotonic() - t0 >= 0.6 and len(fake.hits) > 1  # retried: 503 is how a server starts
        assert why is not None and "is not Triton, or is not ready: GET /v2 gave HTTP 503 (TRITON_URL)" in why
    finally:
        fake.close()


def test_folder_variables_name_themselves(monkeypatch, tmp_path):
    from lab_utils.course import results
    from lab_utils.exercises import quiz

    monkeypatch.setenv("NVLAB_REFERENCE_DIR", str(tmp_path / "missing"))
    with pytest.raises(EnvError, match="NVLAB_REFERENCE_DIR=.*no such folder"):
        results.reference_dirs()
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("NVLAB_RESULTS_DIR", str(tmp_path / "file"))
    with pytest.raises(EnvError, match="NVLAB_RESULTS_DIR=.*is a file"):
        results.results_dir()
    monkeypatch.setenv("NVLAB_QUIZ_DIR", str(tmp_path / "nope"))
    with pytest.raises(EnvError, match="NVLAB_QUIZ_DIR=.*question files"):
        quiz.bank_folder()
    monkeypatch.setenv("NVLAB_REFERENCE_DIR", str(tmp_path))
    assert results.reference_dirs() == [tmp_path]
