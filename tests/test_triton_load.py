"""The closed-loop load generator against a real server: counts, percentiles, the statistics-API split, the
stability rule, client processes, and a server killed mid-load (errors counted, never raised)."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
from _triton import quick_stop, require_server, tiny_repo  # noqa: F401 (an autouse fixture)

from lab_utils.serving import load as triton_load
from lab_utils.serving.load import Window, run_load, server_split
from lab_utils.serving.server import TritonServer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_server()
    repo = tiny_repo(tmp_path_factory.mktemp("load"), dynamic_batching=True)
    with TritonServer(repo) as s:
        yield s


def make_inputs():
    return {"INPUT__0": np.random.rand(1, 4).astype(np.float32)}


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_run_load_counts_and_percentiles(server, protocol):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    seen = []
    r = run_load(url, "tiny", make_inputs, 4, protocol=protocol, window_s=0.3, warmup_s=0.2, max_windows=4,
                 stats_url=server.http_url, on_window=seen.append)
    assert r.requests > 20 and r.errors == 0 and r.errors_total == 0 and r.error_messages == {}
    assert r.throughput_infer_s == pytest.approx(r.requests / r.seconds)
    assert 0 < r.p50_ms <= r.p90_ms <= r.p95_ms <= r.p99_ms
    assert 3 <= len(r.windows) <= 4 and seen == r.windows and isinstance(r.stable, bool)
    assert r.stable == triton_load._stable(r.windows, 0.10)
    s = r.server
    assert s is not None and s["requests"] > 0 and s["batch_avg"] >= 1.0
    assert s["compute_infer_us"] > 0 and s["queue_us"] >= 0 and s["request_us"] >= s["compute_infer_us"]
    row = r.to_row()
    assert row["concurrency"] == 4 and row["server_batch_avg"] == s["batch_avg"] and "p95_ms" in row
    assert "infer/s" in str(r)


def test_fixed_duration_and_batch_rows(server):
    batch4 = {"INPUT__0": np.random.rand(4, 4).astype(np.float32)}  # a dict: the same request every time
    r = run_load(server.grpc_url, "tiny", batch4, 2, duration_s=0.6, window_s=0.2, warmup_s=0.1,
                 stats_url=server.http_url)
    assert len(r.windows) == 3 and r.seconds == pytest.approx(0.6) and r.batch == 4
    assert r.throughput_infer_s == pytest.approx(4 * r.requests / r.seconds)  # inferences, not requests


def test_client_processes(server):
    r = run_load(server.grpc_url, "tiny", make_inputs, 2, window_s=0.3, warmup_s=0.2, max_windows=3, processes=2,
                 stats_url=server.http_url)
    assert r.processes == 2 and r.requests > 10 and r.errors == 0


def test_refused_requests_are_counted_with_their_message(server):
    wrong = {"INPUT__0": np.random.rand(1, 5).astype(np.float32)}
    r = run_load(server.grpc_url, "tiny", wrong, 1, window_s=0.2, warmup_s=0.1, max_windows=3)
    assert r.requests == 0 and r.errors > 0 and r.errors_total >= r.errors
    assert any("unexpected shape" in m for m in r.error_messages)


def test_server_killed_mid_load_is_counted_not_raised(tmp_path):
    require_server()
    repo = tiny_repo(tmp_path)
    with TritonServer(repo) as server:
        windows = []

        def kill_after_first(w):
            windows.append(w)
            if w.requests and server.alive():
                os.kill(server.pid, signal.SIGKILL)

        r = run_load(server.grpc_url, "tiny", make_inputs, 3, duration_s=1.5, window_s=0.3, warmup_s=0.5,
                     stats_url=server.http_url, on_window=kill_after_first)
        assert not server.alive()
        assert any(w.requests for w in r.windows)
        assert r.windows[-1].requests == 0 and r.windows[-1].errors > 0
        assert r.errors > 0 and any("UNAVAILABLE" in m or "unavailable" in m.lower() for m in r.error_messages)
        assert r.server is None or r.server["requests"] >= 0  # the split needs the server; the load numbers stand


def test_stability_rule():
    def ws(*tputs, lat=1.0):
        return [Window(i, 1.0, int(t), 0, t, lat, lat) for i, t in enumerate(tputs)]

    assert triton_load._stable(ws(100, 105, 98), 0.10)
    assert not triton_load._stable(ws(100, 115, 98), 0.10)
    assert not triton_load._stable(ws(100, 100), 0.10)  # three windows are needed
    assert triton_load._stable(ws(50, 100, 105, 98), 0.10)  # the last three count
    assert not triton_load._stable(ws(0, 0, 0), 0.10)  # nothing served is not a stable measurement
    mixed = ws(100, 100, 100)
    mixed[1].mean_ms = 2.0
    assert not triton_load._stable(mixed, 0.10)  # latency must agree too


def test_server_split_arithmetic():
    def snap(n, ns, q, infer, execs):
        return {"inference_count": n, "execution_count": execs, "inference_stats": {
            "success": {"count": n, "ns": ns}, "queue": {"count": n, "ns": q},
            "compute_input": {"count": execs, "ns": 0}, "compute_infer": {"count": execs, "ns": infer},
            "compute_output": {"count": execs, "ns": 0}}}

    s = server_split(snap(10, 1_000_000, 0, 0, 10), snap(110, 11_000_000, 2_000_000, 5_000_000, 35))
    assert s["requests"] == 100 and s["request_us"] == pytest.approx(100)
    assert s["queue_us"] == pytest.approx(20) and s["compute_infer_us"] == pytest.approx(50)
    assert s["batch_avg"] == pytest.approx(4.0) and s["executions"] == 25


def test_bad_arguments():
    with pytest.raises(ValueError, match="protocol"):
        run_load("x:1", "m", make_inputs, 1, protocol="udp")
    with pytest.raises(ValueError, match="concurrency"):
        run_load("x:1", "m", make_inputs, 0)
    with pytest.raises(TypeError, match="numpy"):
        run_load("x:1", "m", lambda: {"INPUT__0": [1, 2]}, 1)


def test_perf_analyzer_command():
    cmd = triton_load.perf_analyzer_command("mlp", "http://127.0.0.1:8001", [4, 8, 12])
    assert cmd.startswith("perf_analyzer -m mlp -u 127.0.0.1:8001 -i grpc")
    assert cmd.endswith("--concurrency-range 4:12:4") and "--stability-percentage 10" in cmd
    loop = triton_load.perf_analyzer_command("mlp", "127.0.0.1:8000", [1, 4, 16], protocol="http", shape="INPUT__0:64")
    assert loop.startswith("for c in 1 4 16; do perf_analyzer") and "--concurrency-range $c; done" in loop
    assert "-i http" in loop and "--shape INPUT__0:64" in loop


def test_no_thread_left_behind(server):
    before = {t.name for t in threading.enumerate()}
    run_load(server.grpc_url, "tiny", make_inputs, 2, window_s=0.2, warmup_s=0.1, max_windows=3)
    assert "nvlab-load" not in {t.name for t in threading.enumerate()} - before
